"""Data vs tensor vs pipeline parallelism on one MLP and one global batch (and the pipeline's
schedules: GPipe, 1F1B, 1F1B with recomputation).

Time per epoch and peak memory per rank are measured; bytes communicated per step are computed
from the layer shapes (no communicator counts its bytes): data parallelism allreduces every
gradient, 2(N-1)/N x params per rank in a ring; tensor parallelism allreduces a batch x units
activation per pair of Dense layers forward and the column layer's input gradient backward;
a pipeline sends each micro-batch's activation forward and its gradient back at every cut.
"""

from __future__ import annotations

import argparse
from typing import Any

from bench.core import markdown_table, median_of, record, spread
from bench.training import add_data_arguments, command, data_flags, measure

NAME = "parallel_modes"
SUMMARY = "data vs tensor vs pipeline: time, bytes per step, peak memory per rank"
QUICK = {"samples": 1024, "hidden": "256,256", "epochs": 2}
MODES = ("data", "tensor", "pipeline-gpipe", "pipeline-1f1b", "pipeline-1f1b-recompute")
ITEM = 4  # float32


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_data_arguments(p, samples=12000)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--hidden", default="1024,1024")
    p.add_argument("--batch-size", type=int, default=256, help="global batch")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES))


def widths(hidden: str) -> list[int]:
    return [784, *(int(h) for h in hidden.split(",")), 10]


def bytes_per_step(mode: str, w: list[int], n: int, batch: int) -> float:
    """Bytes all ranks together send per step, from the shapes (ring allreduce: 2(N-1)/N)."""
    ring = 2 * (n - 1)  # x size: the sum over ranks of 2(N-1)/N x size
    if mode == "data":
        return ring * sum(a * b + b for a, b in zip(w, w[1:], strict=False)) * ITEM
    if mode == "tensor":
        total = 0
        for i in range(0, len(w) - 2, 2):  # pairs of Dense layers (i, i+1)
            total += batch * w[i + 2]  # forward: the row layer's partial sums
            total += batch * w[i] if i > 0 else 0  # backward: the column layer's input grad
        return ring * total * ITEM
    costs = [a * b for a, b in zip(w, w[1:], strict=False)]
    cut = min(range(1, len(costs)), key=lambda k: max(sum(costs[:k]), sum(costs[k:])))
    return 2 * batch * w[cut] * ITEM if n == 2 else float("nan")


def run(args: argparse.Namespace, machine: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    base = [
        "--model", "mlp", "--hidden", args.hidden, "--optimizer", "sgd", "--lr", "0.05",
        "--batch-size", str(args.batch_size), "--epochs", str(args.epochs), *data_flags(args),
    ]  # fmt: skip
    for mode in [m for m in args.modes.split(",") if m]:
        if mode not in MODES:
            raise argparse.ArgumentTypeError(f"--modes: unknown {mode!r} ({', '.join(MODES)})")
        kind, *rest = mode.split("-")
        flags = [*base, "--parallel", kind]
        if kind == "pipeline":
            flags += ["--microbatches", str(args.microbatches), "--pipeline-schedule", rest[0]]
            flags += ["--recompute"] if "recompute" in rest else []
        samples, info = measure(args.ranks, flags, args)
        info["bytes_per_step"] = bytes_per_step(
            kind, widths(args.hidden), args.ranks, args.batch_size
        )
        config = {
            "mode": mode, "ranks": args.ranks, "hidden": args.hidden, "threads": args.threads,
            "batch_size": args.batch_size, "microbatches": args.microbatches,
            "epochs": args.epochs, "dataset": args.dataset,
            "command": command(args.ranks, flags, args),
        }  # fmt: skip
        out.append(record(NAME, config, samples, machine, info))
    return out


def table(records: list[dict[str, Any]]) -> str:
    rows = [
        [
            r["config"]["mode"], r["config"]["ranks"], spread(r, "epoch_s"),
            r["info"]["bytes_per_step"] / 2**20, spread(r, "peak_rss_mb"),
            100 * median_of(r, "test_acc"),
        ]
        for r in records
    ]  # fmt: skip
    heads = ["mode", "ranks", "epoch s", "MiB sent per step", "peak RSS MB/rank", "test acc %"]
    return markdown_table(heads, rows)


def plot(records: list[dict[str, Any]], ax: Any) -> None:
    names = [r["config"]["mode"] for r in records]
    ax.bar(names, [median_of(r, "epoch_s") for r in records], color="C0")
    ax.set(ylabel="seconds per epoch", title="parallel modes")
    ax.tick_params(axis="x", labelrotation=30, labelsize=7)
    twin = ax.twinx()
    twin.plot(names, [median_of(r, "peak_rss_mb") for r in records], "rs", label="peak RSS")
    twin.set_ylabel("peak RSS MB per rank")
