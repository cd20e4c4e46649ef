"""A merged trace drawn with matplotlib (``trace --png``): each rank's lanes, the last steps."""

import io
from typing import Any

from xpnn.record.files import replace_whole

COLOURS = {
    "forward": "#4C72B0",
    "backward": "#DD8452",
    "loss": "#8172B3",
    "update": "#55A868",
    "wait": "#C44E52",
    "communication": "#937860",
    "post": "#DA8BC3",
    "evaluation": "#8C8C8C",
    "other": "#E5E5E5",
}


def _kind(event: dict[str, Any]) -> str | None:
    """What a compute-lane span is drawn as (None: not drawn, e.g. the step itself)."""
    name, cat = event["name"], event["cat"]
    if cat in ("wait", "post", "evaluation"):
        return cat
    if cat == "phase":
        return "update" if name == "update" else None
    kinds = ("forward", "backward", "loss") if cat == "span" and "micro-batch" not in name else ()
    return next((kind for kind in kinds if name.startswith(kind)), None)


def draw(merged: dict[str, Any], path: str, steps: int = 2) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = [e for e in merged["traceEvents"] if e.get("ph") == "X"]
    traced = [e for e in events if e.get("cat") == "step"]  # drawn: rank 0's last ``steps``
    first = min(e["pid"] for e in traced)
    last = sorted((e for e in traced if e["pid"] == first), key=lambda e: e["ts"])[-steps:]
    start, end = last[0]["ts"], last[-1]["ts"] + last[-1]["dur"]
    visible = [e for e in events if e["ts"] < end and e["ts"] + e["dur"] > start]
    ranks = sorted({e["pid"] for e in visible})
    rows: list[str] = []
    fig, ax = plt.subplots(figsize=(11, 1.2 + 1.1 * len(ranks)), layout="constrained")
    for rank in ranks:
        mine = [e for e in visible if e["pid"] == rank]
        comm = [e for e in mine if e["cat"] == "communication"]
        micro = [e for e in mine if e["cat"] == "span" and "micro-batch" in e["name"]]
        lanes = sorted({e["tid"] for e in comm})
        for e in comm:  # one thin bar per communication lane, side by side
            height = 0.8 / len(lanes)
            top = len(rows) + height * lanes.index(e["tid"])
            ax.broken_barh([_bar(e, start)], (top, height * 0.9), color=COLOURS["communication"])
        if comm:
            rows.append(f"rank {rank} communication")
        y = len(rows)
        step_bars = [_bar(e, start) for e in mine if e["cat"] == "step"]
        ax.broken_barh(step_bars, (y, 0.8), color=COLOURS["other"])  # the step outside every span
        for kind in ("forward", "backward", "loss", "update", "post", "evaluation", "wait"):
            if bars := [_bar(e, start) for e in mine if _kind(e) == kind]:
                ax.broken_barh(bars, (y, 0.8), color=COLOURS[kind])
        rows.append(f"rank {rank} compute")
        y += 1
        if micro:
            for e in micro:
                colour = COLOURS["forward" if e["name"].startswith("forward") else "backward"]
                ax.broken_barh([_bar(e, start)], (y, 0.8), color=colour, alpha=0.5)
                label = e["name"][0].upper() + e["name"].split()[-1]
                ax.text(
                    (e["ts"] - start + e["dur"] / 2) / 1e3, y + 0.4, label,
                    ha="center", va="center", fontsize=9, clip_on=True,
                )  # fmt: skip
            rows.append(f"rank {rank} micro-batches")
    ax.set_yticks([i + 0.4 for i in range(len(rows))], rows)
    ax.set(ylim=(len(rows), -0.2), xlim=(0, (end - start) / 1e3))  # the first rank on top
    ax.set_xlabel(f"time in the last {steps} traced step(s), ms (rank 0's clock)")
    ax.grid(axis="x", alpha=0.3)
    shown = [k for k in COLOURS if any(_kind(e) == k for e in visible)]
    if any(e["cat"] == "communication" for e in visible):
        shown.append("communication")
    shown.append("other")
    names = {"post": "posting an operation", "other": "step, in no span", "wait": "waiting"}
    handles = [Patch(color=COLOURS[k], label=names.get(k, k)) for k in dict.fromkeys(shown)]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=5,
              frameon=False, fontsize=10)  # fmt: skip
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=110)
    plt.close(fig)
    replace_whole(path, image.getvalue())  # whole or not at all, never through a link


def _bar(event: dict[str, Any], origin: float) -> tuple[float, float]:
    return (event["ts"] - origin) / 1e3, event["dur"] / 1e3
