"""Data vs tensor vs pipeline parallelism on one MLP and one global batch (and the pipeline's
schedules: GPipe, 1F1B, 1F1B with recomputation).

Time per epoch and peak memory per rank are measured and the bytes sent per step counted: by
the communicators, the payload all ranks together hand to MPI per training step
(the metrics file's ``comm_bytes_per_step``; how many bytes a ring allreduce puts on the wire
is the MPI library's business). Every mode runs over ``--comm mpi-host`` by default: tensor
and pipeline parallelism cannot share memory, and data parallelism over ``mpi-shm`` works in
memory shared by the node's ranks, sending no bytes through MPI on one node.
"""

from __future__ import annotations

import argparse
from typing import Any

from bench.core import markdown_table, median_of, record, spread
from bench.flags import positive_int, rank_count
from bench.plots import legend
from bench.predicted import LABEL, predicted
from bench.training import add_data_arguments, command, data_flags, measure_sides

NAME = "parallel_modes"
SUMMARY = "data vs tensor vs pipeline: time, bytes per step, peak memory per rank"
QUICK = {"samples": 1024, "hidden": "256,256", "epochs": 2}
MODES = ("data", "tensor", "pipeline-gpipe", "pipeline-1f1b", "pipeline-1f1b-recompute")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_data_arguments(p, samples=12000)
    p.add_argument("--ranks", type=rank_count, default=2)
    p.add_argument("--hidden", default="1024,1024")
    p.add_argument("--batch-size", type=positive_int, default=256, help="global batch")
    p.add_argument("--microbatches", type=positive_int, default=4)
    p.add_argument("--epochs", type=positive_int, default=3)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--comm", default="mpi-host", help="xpnn --comm for every mode")


def run(args: argparse.Namespace, machine: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    base = [
        "--model", "mlp", "--hidden", args.hidden, "--optimizer", "sgd", "--lr", "0.05",
        "--batch-size", str(args.batch_size), "--epochs", str(args.epochs), *data_flags(args),
        "--comm", args.comm,
    ]  # fmt: skip
    modes = [m for m in args.modes.split(",") if m]
    sides = []
    for mode in modes:
        if mode not in MODES:
            raise argparse.ArgumentTypeError(f"--modes: unknown {mode!r} ({', '.join(MODES)})")
        kind, *rest = mode.split("-")
        flags = [*base, "--parallel", kind]
        if kind == "pipeline":
            flags += ["--microbatches", str(args.microbatches), "--pipeline-schedule", rest[0]]
            flags += ["--recompute"] if "recompute" in rest else []
        sides.append((args.ranks, flags))
    for mode, (_, flags), (samples, info) in zip(
        modes, sides, measure_sides(sides, args), strict=True
    ):
        config = {
            "mode": mode, "ranks": args.ranks, "hidden": args.hidden, "threads": args.threads,
            "batch_size": args.batch_size, "microbatches": args.microbatches,
            "epochs": args.epochs, "dataset": args.dataset, "comm": args.comm,
            "command": command(args.ranks, flags, args),
        }  # fmt: skip
        out.append(record(NAME, config, samples, machine, info))
    return out


def table(records: list[dict[str, Any]]) -> str:
    rows = [
        [
            r["config"]["mode"], r["config"]["ranks"], spread(r, "epoch_s"),
            predicted(r, "epoch_s"), mib_sent(r), spread(r, "peak_rss_mb"),
            100 * median_of(r, "test_acc"),
        ]
        for r in records
    ]  # fmt: skip
    heads = ["mode", "ranks", "epoch s", "predicted epoch s", "MiB to MPI per step (all ranks)"]
    heads += ["peak RSS MB/rank", "test acc %"]
    return markdown_table(heads, rows)


def mib_sent(r: dict[str, Any]) -> float | None:
    """The counted payload bytes per step, all ranks together, in MiB (None: not counted)."""
    sent = median_of(r, "comm_bytes_per_step")
    return None if sent is None else sent / 2**20


def plot(records: list[dict[str, Any]], ax: Any) -> None:
    """Seconds per epoch (bars) and peak memory per rank (markers, right axis) per mode."""
    names = [r["config"]["mode"] for r in records]
    med = [median_of(r, "epoch_s") or 0.0 for r in records]
    ranges = [r["metrics"].get("epoch_s") or {} for r in records]
    err = [
        [m - g.get("min", m) for m, g in zip(med, ranges, strict=True)],
        [g.get("max", m) - m for m, g in zip(med, ranges, strict=True)],
    ]
    ax.bar(names, med, yerr=err, capsize=3, color="C0", label="seconds per epoch (bars: range)")
    ax.set(ylabel="seconds per epoch", title="time and memory")
    guess = [(x, predicted(r, "epoch_s")) for x, r in enumerate(records)]
    guess = [(x, p) for x, p in guess if p is not None]
    if guess:
        ax.plot(*zip(*guess, strict=True), "kx--", label=LABEL)
    tops = [m + e for m, e in zip(med, err[1], strict=True)] + [p for _, p in guess]
    ax.set_ylim(0, 1.6 * max(tops, default=1))
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    twin = ax.twinx()
    rss = [median_of(r, "peak_rss_mb") for r in records]
    twin.plot(names, rss, "rs", label="peak RSS MB per rank (right)")
    twin.set(ylabel="peak RSS MB per rank", ylim=(0, 1.6 * max((v or 0 for v in rss), default=1)))
    legend(ax, twin, loc="upper left")


def plot_bytes(records: list[dict[str, Any]], ax: Any) -> None:
    """What each mode hands to MPI per step, all ranks together: the point of the study."""
    names = [r["config"]["mode"] for r in records]
    sent = [mib_sent(r) or 0.0 for r in records]
    ax.bar(names, sent, color="C2")
    ax.set(ylabel="MiB to MPI per step (all ranks)", title="bytes per step")
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    for x, value in enumerate(sent):
        ax.annotate(f"{value:.2f}", (x, value), ha="center", va="bottom", fontsize=8)
