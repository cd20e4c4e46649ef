"""How good the planner's predictions are on this machine: every layout of the list below is
run for the MLP, the CNN and the GPT, and its measured step (the global batch over the rate of
each epoch after the first) is set beside the step ``python -m xpnn plan`` predicts for it.

Layouts: 1 rank x 1 and 2 threads, 2 batch threads, 2 ranks data / tensor / pipeline (GPipe
and 1F1B), and 4 and 8 ranks of one thread (oversubscribed on a 2-core machine). The planner
measures what its calibration lacks as it goes, so the first model's predictions include the
products' first timings.

``--from RECORD --calibration FILE`` measures nothing: each recorded layout is predicted again
by this checkout's planner from the calibration ``FILE`` (the one the record was taken with,
for instance), beside the steps the record measured.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
from pathlib import Path
from typing import Any

from bench.core import markdown_table, record, run_xpnn

NAME = "plan_accuracy"
SUMMARY = "the planner's predicted step beside the measured one, for every layout it can run"
QUICK = {"samples": 512, "epochs": 2, "models": "mlp"}
LAYOUTS = (  # (ranks, threads, parallel, batch threads, micro-batches, schedule)
    (1, 1, "data", 1, 1, "gpipe"),
    (1, 2, "data", 1, 1, "gpipe"),
    (1, 2, "data", 2, 1, "gpipe"),
    (2, 1, "data", 1, 1, "gpipe"),
    (2, 1, "tensor", 1, 1, "gpipe"),
    (2, 1, "pipeline", 1, 4, "gpipe"),
    (2, 1, "pipeline", 1, 4, "1f1b"),
    (4, 1, "data", 1, 1, "gpipe"),
    (8, 1, "data", 1, 1, "gpipe"),
)
GPT_SPAN = 20  # the GPT's steps between evaluations: a measured span
MODEL_FLAGS = {
    "mlp": ["--model", "mlp", "--batch-size", "128"],
    "cnn": ["--model", "cnn", "--batch-size", "128"],
    "gpt": ["--model", "gpt", "--batch-size", "32", "--dataset", "text"],
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default="mlp,cnn,gpt")
    p.add_argument("--samples", type=int, default=4096, help="synthetic samples (mlp, cnn)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--max-ranks", type=int, default=8)
    p.add_argument("--text", type=Path, default=None, help="the GPT's text (default README.md)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--threads", type=int, default=1)  # the layouts set their own
    p.add_argument(
        "--calibration",
        type=Path,
        default=None,
        help="with --from: predict the recorded layouts again from this calibration file",
    )


def _layout_flags(layout: tuple) -> list[str]:
    ranks, threads, parallel, k, m, schedule = layout
    flags = ["--backend", "numba", "--threads", str(threads)]
    if ranks > 1:
        flags += ["--parallel", parallel]
        flags += ["--comm", "mpi-host"] if parallel != "data" else []
    if k > 1 or threads > 1:  # explicit: the GPT preset takes auto where the flag is not given
        flags += ["--batch-threads", str(k)]
    if parallel == "pipeline":
        flags += ["--microbatches", str(m), "--pipeline-schedule", schedule]
    return flags


def _predict(flags: list[str], layout: tuple, calibration: Path | None = None) -> tuple[float, int]:
    """(predicted step seconds, the global batch) of ``flags`` laid out as ``layout`` (data
    parallelism on the default transport: node-shared memory)."""
    from xpnn.commands import predict_run
    from xpnn.planner import Layout

    comm = "auto" if layout[2] == "data" else "mpi-host"
    where = None if calibration is None else str(calibration)
    pred, batch = predict_run(flags, Layout(*layout, comm=comm), where)
    return pred.step, batch


def layout_of(config: dict[str, Any]) -> tuple:
    """A record's layout tuple (as ``LAYOUTS``'), read from its flags."""
    flags = config["layout"]

    def value(name: str, default: str) -> str:
        return flags[flags.index(name) + 1] if name in flags else default

    return (
        int(config["ranks"]),
        int(value("--threads", "1")),
        value("--parallel", "data"),
        int(value("--batch-threads", "1")),
        int(value("--microbatches", "1")),
        value("--pipeline-schedule", "gpipe"),
    )


def run_flags(command: str) -> list[str]:
    """The training flags of a recorded command line, without its metrics file and its
    text's path (the planner needs the data set's shape, not its data)."""
    words = shlex.split(command)
    words = words[words.index("xpnn") + 1 :]
    out: list[str] = []
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word in ("--metrics", "--data-dir"):
            skip = True
        else:
            out.append(word)
    return out


def reread(records: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """With ``--calibration``: each record predicted again from that file (its recorded
    prediction kept as ``recorded_predicted_step_s``); else the records as they are."""
    if args.calibration is None:
        return records
    from xpnn.planner import load

    digest = load(args.calibration).digest()
    out = []
    for r in records:
        config = dict(r["config"])
        predicted, _ = _predict(run_flags(config["command"]), layout_of(config), args.calibration)
        config.setdefault("recorded_predicted_step_s", config["predicted_step_s"])
        config["predicted_step_s"] = predicted
        config["predicted_from"] = digest
        out.append({**r, "config": config})
    return out


def run(args: argparse.Namespace, machine: dict[str, Any]) -> list[dict[str, Any]]:
    text = args.text or Path(__file__).resolve().parents[2] / "README.md"
    out = []
    for model in [m for m in args.models.split(",") if m]:
        if model not in MODEL_FLAGS:
            raise argparse.ArgumentTypeError(f"--models: unknown {model!r} (mlp, cnn, gpt)")
        base = [*MODEL_FLAGS[model], "--seed", "0"]
        if model == "gpt":  # an epoch of text is 500 steps: spans of GPT_SPAN steps instead
            base += ["--data-dir", str(text), "--layers", "2", "--embed", "64", "--heads", "4"]
            base += ["--steps", str(GPT_SPAN * args.epochs), "--eval-every", str(GPT_SPAN)]
        else:
            base += ["--epochs", str(args.epochs)]
            base += ["--dataset", "synthetic", "--synthetic-size", str(args.samples)]
        for layout in LAYOUTS:
            ranks, _, parallel, *_ = layout
            if ranks > args.max_ranks or (model == "cnn" and parallel == "tensor"):
                continue
            flags = [*base, *_layout_flags(layout)]
            predicted, batch = _predict(flags, layout)  # this machine's calibration
            steps = [measured_step(run_xpnn(ranks, flags, args.timeout), batch)
                     for _ in range(args.repeats)]  # fmt: skip
            launch = f"mpiexec -n {ranks} " if ranks > 1 else ""
            config = {
                "model": model, "layout": _layout_flags(layout), "ranks": ranks,
                "predicted_step_s": predicted,
                "command": f"{launch}python -m xpnn {' '.join(flags)} --metrics m.jsonl",
            }  # fmt: skip
            out.append(record(NAME, config, {"step_s": steps}, machine))
    used = _calibration_used()
    for r in out:
        r["config"]["calibration"] = used
    print(f"calibration: {used['path']} (digest {used['digest']}); keep it beside the records")
    return out


def _calibration_used() -> dict[str, str]:
    """This machine's cached calibration, as the predictions left it (what they measured on
    the way added): its path and digest, for ``--from RECORD --calibration FILE``."""
    from xpnn.planner import cached
    from xpnn.runtime import node_cores

    calibration, path = cached(node_cores())
    return {"path": str(path), "digest": calibration.digest()}


def measured_step(metrics: list[dict[str, Any]], batch: int) -> float:
    """Seconds per step: the global batch over each epoch's (or evaluation span's) rate,
    median after the first."""
    epochs = [m for m in metrics if m.get("event") in ("epoch", "eval")]
    steady = epochs[1:] or epochs
    return statistics.median(batch / float(e["samples_per_s"]) for e in steady)


def errors(records: list[dict[str, Any]]) -> list[float]:
    out = []
    for r in records:
        measured = r["metrics"]["step_s"]["median"]
        out.append((r["config"]["predicted_step_s"] - measured) / measured)
    return out


def table(records: list[dict[str, Any]]) -> str:
    rows = []
    for r, err in zip(records, errors(records), strict=True):
        m = r["metrics"]["step_s"]
        rows.append([
            r["config"]["model"], r["config"]["ranks"], " ".join(r["config"]["layout"]),
            1e3 * r["config"]["predicted_step_s"],
            f"{1e3 * m['median']:.2f} ({1e3 * m['min']:.2f}–{1e3 * m['max']:.2f})",
            f"{100 * err:+.0f}%",
        ])  # fmt: skip
    text = markdown_table(["model", "ranks", "flags", "predicted ms", "measured ms", "error"], rows)
    errs = [abs(e) for e in errors(records)]
    if errs:
        text += (
            f"\n\nmedian |error| {100 * statistics.median(errs):.0f}%, "
            f"worst {100 * max(errs):.0f}%, {len(errs)} layouts"
        )
        gaps = pick_gaps(records)
        for model, gap in gaps.items():
            text += f"\n{model}: the predicted best is {100 * gap:.0f}% behind the measured best"
        text += _near("plan's picks (any layout of a model)", gaps)
        text += _near("auto's picks (the layouts of one rank count)", pick_gaps(records, "ranks"))
        recorded = [r["config"].get("recorded_predicted_step_s") for r in records]
        if all(v is not None for v in recorded):
            was = [
                abs(v / r["metrics"]["step_s"]["median"] - 1)
                for v, r in zip(recorded, records, strict=True)
            ]
            text += (
                f"\npredicted again from the calibration given ({_whose(records)}); the record's "
                f"own predictions: median |error| {100 * statistics.median(was):.0f}%, "
                f"worst {100 * max(was):.0f}%"
            )
    return text


def _whose(records: list[dict[str, Any]]) -> str:
    """Whether the calibration predicted from is the one the record says it used."""
    named = {(r["config"].get("calibration") or {}).get("digest") for r in records}
    given = {r["config"].get("predicted_from") for r in records}
    if named == {None}:
        return "the record names no calibration"
    return "the record's own" if named == given else "not the one the record used"


PICK_WITHIN = 0.10  # a pick this close to the measured best counts as a right one


def _near(what: str, gaps: dict[Any, float]) -> str:
    near = sum(1 for gap in gaps.values() if gap <= PICK_WITHIN)
    return f"\n{what} within {100 * PICK_WITHIN:.0f}% of the measured best: {near} of {len(gaps)}"


def pick_gaps(records: list[dict[str, Any]], within: str | None = None) -> dict[Any, float]:
    """For each model (``within="ranks"``: each model and rank count with a choice to make):
    how far the measured step of the layout predicted fastest is behind the fastest measured
    (0: the planner picked the best)."""
    groups: dict[Any, list[dict[str, Any]]] = {}
    for r in records:
        key = r["config"]["model"]
        if within:
            key = (key, r["config"][within])
        groups.setdefault(key, []).append(r)
    out = {}
    for key, mine in groups.items():
        if len(mine) < 2:
            continue  # one layout: nothing to choose
        picked = min(mine, key=lambda r: r["config"]["predicted_step_s"])
        best = min(r["metrics"]["step_s"]["median"] for r in mine)
        out[key] = picked["metrics"]["step_s"]["median"] / best - 1
    return out


def plot(records: list[dict[str, Any]], ax: Any) -> None:
    for model in dict.fromkeys(r["config"]["model"] for r in records):
        mine = [r for r in records if r["config"]["model"] == model]
        ax.scatter(
            [1e3 * r["config"]["predicted_step_s"] for r in mine],
            [1e3 * r["metrics"]["step_s"]["median"] for r in mine],
            label=model,
        )
    lims = ax.get_xlim()
    ax.plot(lims, lims, color="grey", linewidth=0.8, label="measured = predicted")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("predicted step (ms)")
    ax.set_ylabel("measured step (ms)")
    ax.set_title("The planner's predictions against measured steps")
    ax.legend()
