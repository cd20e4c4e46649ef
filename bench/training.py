"""What every training benchmark shares: the data flags, one timed run, its numbers.

A run is ``mpiexec -n N python -m xpnn ... --metrics FILE``; what it measured is read from
the metrics file (the CLI's stable contract), never parsed from its printed output.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from bench.core import done_of, epochs_of, run_xpnn
from bench.flags import positive_float, positive_int


def add_data_arguments(p: argparse.ArgumentParser, samples: int) -> None:
    p.add_argument(
        "--dataset", default="synthetic", choices=("synthetic", "mnist", "fashion-mnist")
    )
    p.add_argument("--data-dir", help="directory of the four IDX files (mnist, fashion-mnist)")
    p.add_argument(
        "--samples",
        type=positive_int,
        default=samples,
        help="--dataset synthetic: training samples",
    )
    p.add_argument("--repeats", type=positive_int, default=1, help="runs of each configuration")
    p.add_argument("--threads", type=positive_int, default=1, help="BLAS threads per rank")
    p.add_argument("--timeout", type=positive_float, default=1800, help="seconds allowed per run")


def data_flags(args: argparse.Namespace, samples: int | None = None) -> list[str]:
    flags = ["--dataset", args.dataset]
    if args.dataset == "synthetic":
        flags += ["--synthetic-size", str(samples or args.samples)]
    elif args.data_dir:
        flags += ["--data-dir", args.data_dir]
    return flags


def train_samples(args: argparse.Namespace) -> int:
    return args.samples if args.dataset == "synthetic" else 60_000


def run_flags(flags: Sequence[str], args: argparse.Namespace) -> list[str]:
    return [*flags, "--threads", str(args.threads), "--seed", "0"]


def command(
    ranks: int, flags: Sequence[str], args: argparse.Namespace, launcher: bool = True
) -> str:
    """The command line a reader can paste to repeat one run (metrics to m.jsonl)."""
    launch = f"mpiexec -n {ranks} " if launcher else ""
    return f"{launch}python -m xpnn {' '.join(run_flags(flags, args))} --metrics m.jsonl"


def timed_run(
    ranks: int, flags: Sequence[str], args: argparse.Namespace, launcher: bool = True
) -> dict[str, Any]:
    """One training run's numbers: per-epoch time (median after the first when there are more
    than two), training time, final test metrics, peak memory per rank, the payload bytes all
    ranks handed to MPI per training step (median over epochs), every epoch's record."""
    metrics = run_xpnn(ranks if launcher else 0, run_flags(flags, args), args.timeout)
    epochs = epochs_of(metrics)
    done = done_of(metrics)
    seconds = [float(e["seconds"]) for e in epochs]
    steady = seconds[1:] if len(seconds) > 2 else seconds
    rss = done.get("peak_rss_mb") or []
    sent = sorted(float(e["comm_bytes_per_step"]) for e in epochs if "comm_bytes_per_step" in e)
    return {
        "epoch_s": sorted(steady)[len(steady) // 2],
        "train_s": sum(seconds),
        "test_acc": done.get("test_acc"),
        "test_loss": done.get("test_loss"),
        "peak_rss_mb": max(rss) if rss else None,
        "comm_bytes_per_step": sent[len(sent) // 2] if sent else None,
        "epochs": epochs,
        "done": done,
    }


NUMBERS = ("epoch_s", "train_s", "test_acc", "test_loss", "peak_rss_mb", "comm_bytes_per_step")


def numbers(run: dict[str, Any]) -> dict[str, float]:
    return {k: run[k] for k in NUMBERS if run.get(k) is not None}


def run_info(run: dict[str, Any]) -> dict[str, Any]:
    """What the run said about itself (comm, params, per-epoch curves) for the record."""
    d = run["done"]
    keep = ("params", "world_size", "comm", "update", "parallel", "global_batch", "threads")
    keep += ("peak_rss_mb",)  # by rank
    info = {k: d.get(k) for k in keep}
    info["curve"] = [
        {k: e.get(k) for k in ("epoch", "train_loss", "test_loss", "test_acc", "seconds")}
        for e in run["epochs"]
    ]
    return info


def measure_sides(
    sides: Sequence[tuple[int, Sequence[str]]], args: argparse.Namespace
) -> list[tuple[dict[str, list[float]], dict[str, Any]]]:
    """``args.repeats`` runs of each side (ranks, flags) compared in one benchmark, the sides
    alternated round by round (the order reversed each round), so that a drift of the
    machine's speed falls on every side alike; per side, as ``measure`` returns it."""
    samples: list[dict[str, list[float]]] = [{} for _ in sides]
    last: list[dict[str, Any]] = [{} for _ in sides]
    order = list(range(len(sides)))
    for r in range(args.repeats):
        for i in order if r % 2 == 0 else order[::-1]:
            last[i] = timed_run(sides[i][0], sides[i][1], args)
            for k, v in numbers(last[i]).items():
                samples[i].setdefault(k, []).append(float(v))
    return [(samples[i], run_info(last[i])) for i in order]
