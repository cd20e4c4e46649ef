"""Speedup as the work per sample grows: one hidden layer made wider (seed 003's question).

With little work per sample the fixed costs of a step (Python, the allreduce's latency)
dominate and more ranks do not pay; widening the hidden layer adds multiply-adds per sample
until the ranks' share of the arithmetic outweighs them.
"""

from __future__ import annotations

import argparse
from typing import Any

from bench.core import markdown_table, median_of, record, spread
from bench.flags import int_list, positive_int, rank_list
from bench.predicted import LABEL, predicted
from bench.training import add_data_arguments, command, data_flags, measure_sides

NAME = "granularity"
SUMMARY = "time per epoch and speedup as the hidden width grows (seed 003)"
QUICK = {"samples": 2000, "widths": [16, 512], "epochs": 2}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_data_arguments(p, samples=12000)
    p.add_argument("--ranks", type=rank_list, default=[1, 2], help="comma list of rank counts")
    p.add_argument("--widths", type=int_list, default=[16, 64, 256, 1024, 4096])
    p.add_argument("--batch-size", type=positive_int, default=256, help="global batch")
    p.add_argument("--epochs", type=positive_int, default=3)


def run(args: argparse.Namespace, machine: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for width in args.widths:
        flags = [
            "--model", "mlp", "--hidden", str(width), "--optimizer", "sgd", "--lr", "0.05",
            "--batch-size", str(args.batch_size), "--epochs", str(args.epochs),
            *data_flags(args),
        ]  # fmt: skip
        sides = [(n, flags) for n in args.ranks]
        for n, (samples, info) in zip(args.ranks, measure_sides(sides, args), strict=True):
            config = {
                "width": width, "ranks": n, "threads": args.threads,
                "batch_size": args.batch_size, "epochs": args.epochs, "dataset": args.dataset,
                "macs_per_sample": 784 * width + width * 10,
                "command": command(n, flags, args),
            }  # fmt: skip
            out.append(record(NAME, config, samples, machine, info))
    return out


def rows(records: list[dict[str, Any]]) -> list[list[Any]]:
    out = []
    for width in sorted({r["config"]["width"] for r in records}):
        rs = sorted(
            (r for r in records if r["config"]["width"] == width),
            key=lambda r: r["config"]["ranks"],
        )
        base, p0 = median_of(rs[0], "epoch_s"), predicted(rs[0], "epoch_s")
        for r in rs:
            n = r["config"]["ranks"]
            s = base / median_of(r, "epoch_s")
            p = predicted(r, "epoch_s")
            p_speedup = None if p is None or p0 is None else p0 / p
            out.append([width, r["config"]["macs_per_sample"], n, spread(r, "epoch_s"), s, s / n,
                        p, p_speedup])  # fmt: skip
    return out


def table(records: list[dict[str, Any]]) -> str:
    heads = ["hidden width", "MACs/sample", "ranks", "epoch s", "speedup", "efficiency"]
    heads += ["predicted epoch s", "predicted speedup"]
    return markdown_table(heads, rows(records))


def plot(records: list[dict[str, Any]], ax: Any) -> None:
    rs = rows(records)
    for n in sorted({r[2] for r in rs}):
        pts = [(r[1], r[4]) for r in rs if r[2] == n]
        line = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{n} ranks")
        guess = [(r[1], r[7]) for r in rs if r[2] == n and r[7] is not None]
        if guess and n > min(r[2] for r in rs):  # the fewest ranks' predicted speedup is 1
            ax.plot(*zip(*guess, strict=True), "x--", color=line[0].get_color(),
                    label=f"{n} ranks: {LABEL}")  # fmt: skip
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xscale="log", xlabel="multiply-adds per sample", ylabel="speedup over 1 rank")
    ax.set_ylim(bottom=0)
    ax.set_title("granularity")
    ax.legend(fontsize=9)
