"""The 690,590-parameter CNN, data parallel, batch 128 per rank, lr 0.001 x ranks (seed 002).

Its Table 2: time per epoch (median of the epochs), test loss and accuracy against the number
of processes, Adam, 5 epochs. The global batch grows with the ranks, as there.
"""

from __future__ import annotations

import argparse
from typing import Any

from bench.core import markdown_table, median_of, record, speedup, spread
from bench.flags import positive_float, positive_int, rank_list
from bench.plots import count_axis, legend
from bench.predicted import LABEL, predicted
from bench.training import add_data_arguments, command, data_flags, measure_sides

NAME = "cnn"
SUMMARY = "CNN time per epoch and test accuracy vs processes, lr x ranks (seed 002)"
QUICK = {"samples": 256, "epochs": 2}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_data_arguments(p, samples=6000)
    p.add_argument("--ranks", type=rank_list, default=[1, 2], help="comma list of rank counts")
    p.add_argument("--per-rank-batch", type=positive_int, default=128)
    p.add_argument("--lr", type=positive_float, default=0.001, help="times the number of ranks")
    p.add_argument("--epochs", type=positive_int, default=5)


def run(args: argparse.Namespace, machine: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    sides = [(n, [
        "--model", "cnn", "--optimizer", "adam", "--lr", repr(args.lr * n),
        "--per-rank-batch", str(args.per_rank_batch), "--epochs", str(args.epochs),
        *data_flags(args),
    ]) for n in args.ranks]  # fmt: skip
    for (n, flags), (samples, info) in zip(sides, measure_sides(sides, args), strict=True):
        config = {
            "ranks": n, "threads": args.threads, "per_rank_batch": args.per_rank_batch,
            "lr": args.lr * n, "epochs": args.epochs, "dataset": args.dataset,
            "train_samples": args.samples if args.dataset == "synthetic" else 60_000,
            "command": command(n, flags, args),
        }  # fmt: skip
        out.append(record(NAME, config, samples, machine, info))
    return out


def table(records: list[dict[str, Any]]) -> str:
    rs = sorted(records, key=lambda r: r["config"]["ranks"])
    rows = [
        [
            r["config"]["ranks"], r["config"]["ranks"] * r["config"]["per_rank_batch"],
            r["config"]["lr"], spread(r, "epoch_s"),
            speedup(rs[0], r, "epoch_s", r["config"]["ranks"] / rs[0]["config"]["ranks"]),
            predicted(r, "epoch_s"),
            median_of(r, "test_loss"), 100 * median_of(r, "test_acc"),
        ]
        for r in rs
    ]  # fmt: skip
    heads = ["processes", "global batch", "lr", "epoch s", "speedup", "predicted epoch s"]
    heads += ["test loss", "test acc %"]
    return markdown_table(heads, rows)


def plot(records: list[dict[str, Any]], ax: Any) -> None:
    rs = sorted(records, key=lambda r: r["config"]["ranks"])
    n = [r["config"]["ranks"] for r in rs]
    ax.plot(n, [median_of(r, "epoch_s") for r in rs], "o-", label="seconds per epoch")
    guess = [(r["config"]["ranks"], predicted(r, "epoch_s")) for r in rs]
    guess = [(x, p) for x, p in guess if p is not None]
    if guess:
        ax.plot(*zip(*guess, strict=True), "x--", color="C0", label=LABEL)
    ax.set(xlabel="processes", ylabel="seconds per epoch", title="CNN data parallel")
    ax.set_ylim(bottom=0)
    count_axis(ax, n)
    twin = ax.twinx()
    acc = [100 * median_of(r, "test_acc") for r in rs]
    twin.plot(n, acc, "s--", color="C1", label="test accuracy % (right)")
    twin.set(ylabel="test accuracy %", ylim=(0, 100))  # a change of 0.3 points looks like one
    legend(ax, twin, loc="lower left")
