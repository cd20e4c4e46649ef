"""``python -m xpnn plot METRICS.jsonl [more.jsonl ...] [-o FILE.png]``: training curves.
Also the merged timeline of ``trace --png``: each rank's lanes over the last steps."""

import argparse
import io
import json
import sys
from pathlib import Path
from typing import Any

from xpnn.errors import UserError
from xpnn.record.files import check_output, read_regular, replace_whole

INSTALL = "matplotlib is not installed: pip install 'xpnn[plot]' (or pip install matplotlib)"
PANELS = (
    ("loss", ("train_loss", "test_loss")),
    ("accuracy", ("train_acc", "test_acc")),
    ("throughput", ("samples_per_s", "tokens_per_s")),
)
MOST_BYTES = 256 * 2**20  # a metrics file of 10^6 epochs is about this big; more is not one


def read_epochs(path: Path) -> list[dict[str, Any]]:
    """The epoch (or eval) records of one metrics file; a UserError for anything else."""
    data = read_regular(path, MOST_BYTES, str(path), "an xpnn --metrics file")
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a text file (is it an xpnn --metrics file?)") from None
    epochs = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError) as e:  # RecursionError: "[[[[..." nested deep
            raise UserError(f"{path}: line {i} is not JSON ({getattr(e, 'msg', e)})") from None
        # a run by --steps writes eval records, at fractions of an epoch
        if isinstance(rec, dict) and rec.get("event") in ("epoch", "eval"):
            _check_record(path, i, rec)
            epochs.append(rec)
    if not epochs:
        raise UserError(f"{path}: no epoch records (is it an xpnn --metrics file?)")
    return epochs


def _check_record(path: Path, line: int, rec: dict[str, Any]) -> None:
    epoch = rec.get("epoch")
    number = isinstance(epoch, int | float) and not isinstance(epoch, bool) and 0 <= epoch < 2**53
    if rec.get("event") == "eval" and not number:  # at a fraction of an epoch
        raise UserError(f"{path}: line {line}: an eval record without an epoch number")
    if rec.get("event") != "eval" and not (number and isinstance(epoch, int)):
        raise UserError(f"{path}: line {line}: an epoch record without a whole-number epoch")
    for key in ("step", *(key for _, keys in PANELS for key in keys)):
        value = rec.get(key)
        bad = isinstance(value, bool) or not isinstance(value, int | float)
        if value is not None and (bad or isinstance(value, int) and abs(value) >= 2**1000):
            raise UserError(f"{path}: line {line}: {key} is not a number ({value!r:.40})")


def is_text(epochs: list[dict[str, Any]]) -> bool:
    """A text model's run: its records say tokens/s and validation loss (docs/cli.md)."""
    return any("tokens_per_s" in e or "val_loss" in e for e in epochs)


def series(key: str, text: bool) -> str:
    """The name of a curve as the docs name it: validation for a text model's held-out set."""
    split, _, what = key.partition("_")
    if key in ("samples_per_s", "tokens_per_s"):
        return key.replace("_per_s", "/s")
    return f"{'validation' if text and split == 'test' else split} {what}"


def draw(paths: list[Path], out: Path) -> Path:
    """One PNG, a panel per quantity, a line per run (dashed: test or validation)."""
    check_output(f"-o {out}", str(out), paths, "a metrics file", ".png")
    runs = [(p, read_epochs(p)) for p in paths]
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError(INSTALL) from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    records = [e for _, es in runs for e in es]  # every run by ``--steps``: steps on the x axis
    steps = all(e.get("event") == "eval" and isinstance(e.get("step"), int) for e in records)
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4))
    for i, (path, epochs) in enumerate(runs):
        x = [e["step"] if steps else e["epoch"] for e in epochs]
        first, text = epochs[0], is_text(epochs)
        label = f"{path.stem} ({first.get('world_size', '?')} rank(s), {first.get('backend', '?')})"
        for ax, (_, keys) in zip(axes, PANELS, strict=True):
            if keys[0] == "samples_per_s":  # a text model's rate is in tokens, as its docs say
                keys = ("tokens_per_s" if text else "samples_per_s",)
            for key in keys:
                y = [e.get(key) for e in epochs]
                if all(v is None for v in y):
                    continue
                style = "--" if key.startswith("test") else "-"
                ax.plot(x, y, style, color=f"C{i}", marker="o", ms=3,
                        label=f"{label} {series(key, text)}")  # fmt: skip
    xlabel = "step (optimizer steps)" if steps else "epoch"
    text = [is_text(es) for _, es in runs]
    rate = "tokens" if all(text) else "samples" if not any(text) else "samples or tokens"
    loss = f"loss (nats per {'character' if all(text) else 'sample'})"
    ylabels = {"loss": loss, "accuracy": "accuracy (fraction correct)", "throughput": f"{rate} / s"}
    for ax, (title, _) in zip(axes, PANELS, strict=True):
        ax.set(xlabel=xlabel, ylabel=ylabels[title], title=title)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs and steps are counts
        ax.set_ylim(bottom=0, top=1.0 if title == "accuracy" else None)  # a change is no cliff
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=9)
        else:  # nothing of this panel in the files: say so, with no empty legend
            ax.text(0.5, 0.5, f"no {title} in the file(s)", ha="center", va="center",
                    transform=ax.transAxes, fontsize=9, color="0.4")  # fmt: skip
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, dpi=100, format="png")
    plt.close(fig)
    replace_whole(out, image.getvalue())  # whole or not at all, never through a link
    return out


class OneLineParser(argparse.ArgumentParser):
    """A bad flag as one line (after ``said``), with no usage dump."""

    said = ""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(self.said + message.removeprefix("argument "))


def main(argv: list[str]) -> int:
    about = __doc__.splitlines()[0].replace("``", "")
    p = OneLineParser(prog="python -m xpnn plot", description=about)
    p.add_argument("metrics", nargs="+", type=Path, help="metrics files (--metrics FILE.jsonl)")
    p.add_argument("-o", "--out", type=Path, default=Path("metrics.png"), help="PNG to write")
    try:
        args = p.parse_args(argv)
        out = draw(args.metrics, args.out)
    except (ImportError, UserError) as e:
        print(f"xpnn plot: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"xpnn plot: -o {args.out}: cannot write ({e.strerror or e})", file=sys.stderr)
        return 2
    print(f"xpnn plot: {out}")
    return 0


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


def draw_timeline(merged: dict[str, Any], path: str, steps: int = 2) -> None:
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
