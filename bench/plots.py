"""Figures drawn from records (matplotlib, headless)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend; ImportError says how to install it."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("matplotlib is not installed: pip install 'xpnn[plot]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw(
    path: Path, panels: list[Callable[[Any], None]], title: str = "", notes: list[str] = ()
) -> Path:
    """One PNG with a panel per callable (each draws on the Axes it is given); ``notes`` (a
    quick run, noisy measurements: ``core.marks``) go in red under the title and into every
    panel's title, so a figure cut out of the report still says so."""
    plt = pyplot()
    high = 4 + 0.25 * len(notes)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), high), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        panel(ax)
        if notes:
            short = " · ".join(n.split(":")[0] for n in notes)
            ax.set_title(f"{ax.get_title()}\n[{short}]", fontsize=9, color="C3")
    if title or notes:
        fig.suptitle("\n".join([title, *notes]).strip(), fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def count_axis(ax: Any, values: list[int], axis: str = "x") -> None:
    """A count (ranks, processes) on ``axis``: a tick at each value drawn, no fractions."""
    ticks = sorted(set(values))
    if axis == "x":
        ax.set_xticks(ticks, [str(t) for t in ticks])
    else:
        ax.set_yticks(ticks, [str(t) for t in ticks])


def legend(ax: Any, *others: Any, **kwargs: Any) -> None:
    """One legend for ``ax`` and the axes sharing it (a ``twinx``): every labelled line."""
    handles, labels = ax.get_legend_handles_labels()
    for other in others:
        h, lab = other.get_legend_handles_labels()
        handles, labels = handles + h, labels + lab
    ax.legend(handles, labels, **{"fontsize": 9, **kwargs})
