"""What splitting the batch over ranks can give an MLP's matrix products, at best.

Data parallelism on N ranks runs each product of a training step with B / N rows instead of B.
This times every product of one step (forward ``x @ W``, weight gradient ``x.T @ dz`` into a
buffer, input gradient ``dz @ W.T`` for all but the first layer) at the global batch and at
one rank's share (the larger share where B does not divide), in cache, at ``--threads`` BLAS
threads (one, as each rank runs). An ideal split gives 1 / N; what is above it is the
products' own loss of efficiency at fewer rows, before any communication: the inverse of the
total ratio bounds the speedup the products alone allow. Samples alternate the two sizes.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial
from itertools import pairwise
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from bench.core import markdown_table, median_of, record, spread
from bench.flags import int_list, nonneg_float, positive_int, rank_count

NAME = "gemm_split"
SUMMARY = "an MLP step's matrix products at the global batch vs one rank's share"
REPEATS = "samples"  # the flag counting its repeats
QUICK = {"hidden": [256], "samples": 3, "seconds": 0.02}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hidden", type=int_list, default=[1024, 1024], help="hidden sizes")
    p.add_argument("--inputs", type=positive_int, default=784)
    p.add_argument("--classes", type=positive_int, default=10)
    p.add_argument("--batch", type=positive_int, default=128, help="global batch")
    p.add_argument("--ranks", type=rank_count, default=2, help="ranks the batch is split over")
    p.add_argument("--threads", type=positive_int, default=1, help="BLAS threads (one per rank)")
    p.add_argument("--samples", type=positive_int, default=7, help="timed samples per batch size")
    p.add_argument(
        "--seconds", type=nonneg_float, default=0.2, help="calls per sample fill this long"
    )


def products(inputs: int, hidden: list[int], classes: int) -> list[tuple[str, str, Callable]]:
    """(name, shape, maker) for every product of one step; ``maker(n)`` returns the call."""
    rng = np.random.default_rng(0)

    def rand(*shape: int) -> np.ndarray:
        return rng.random(shape, dtype=np.float32)

    out = []
    for i, (a, b) in enumerate(pairwise([inputs, *hidden, classes])):
        w, grad = rand(a, b), np.empty((a, b), np.float32)  # the gradient lands in a buffer
        out.append((f"layer {i} forward", f"B×{a} @ {a}×{b}",
                    lambda n, a=a, w=w: partial(np.matmul, rand(n, a), w)))  # fmt: skip
        out.append((f"layer {i} weight grad", f"{a}×B @ B×{b}",
                    lambda n, a=a, b=b, g=grad:
                    partial(np.matmul, rand(n, a).T, rand(n, b), out=g)))  # fmt: skip
        if i > 0:  # no input gradient for the data
            out.append((f"layer {i} input grad", f"B×{b} @ {b}×{a}",
                        lambda n, b=b, w=w: partial(np.matmul, rand(n, b), w.T)))  # fmt: skip
    return out


def per_call(fn: Callable[[], object], seconds: float) -> float:
    """Seconds per call: as many calls as fill ``seconds`` after a warm-up (timer noise)."""
    t0 = time.perf_counter()
    fn()
    number = max(1, min(100_000, int(seconds / max(time.perf_counter() - t0, 1e-7))))
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - t0) / number


def run(args: argparse.Namespace, machine: dict[str, Any]) -> list[dict[str, Any]]:
    if args.batch < args.ranks:
        raise argparse.ArgumentTypeError(
            f"--batch {args.batch} is below --ranks {args.ranks}: a rank would get no rows"
        )
    share = -(-args.batch // args.ranks)  # the slowest rank's rows
    out = []
    with threadpool_limits(args.threads, user_api="blas"):
        for name, shape, make in products(args.inputs, args.hidden, args.classes):
            calls = {"whole_us": make(args.batch), "share_us": make(share)}
            samples: dict[str, list[float]] = {k: [] for k in calls}
            for s in range(args.samples):
                for k in list(calls) if s % 2 == 0 else list(calls)[::-1]:
                    samples[k].append(per_call(calls[k], args.seconds) * 1e6)
            pairs = zip(samples["share_us"], samples["whole_us"], strict=True)
            samples["ratio"] = [p / w for p, w in pairs]
            config = {"product": name, "shape": shape, "batch": args.batch, "share": share,
                      "ranks": args.ranks, "threads": args.threads,
                      "widths": [args.inputs, *args.hidden, args.classes]}  # fmt: skip
            out.append(record(NAME, config, samples, machine))
    return out


def table(records: list[dict[str, Any]]) -> str:
    rows = [[r["config"]["product"], r["config"]["shape"], spread(r, "whole_us"),
             spread(r, "share_us"), median_of(r, "ratio")] for r in records]  # fmt: skip
    if records:
        whole = sum(median_of(r, "whole_us") for r in records)
        part = sum(median_of(r, "share_us") for r in records)
        c = records[0]["config"]
        rows.append(["all", "", whole, part, part / whole])
        tail = (f"\n\nideal ratio {1 / c['ranks']:.3f}; the products alone allow a speedup of "
                f"at most {whole / part:.2f} on {c['ranks']} ranks")  # fmt: skip
    c = records[0]["config"] if records else {"batch": "B", "share": "B/N"}
    heads = ["product", "shape", f"µs at B={c['batch']}", f"µs at B={c['share']}", "ratio"]
    return markdown_table(heads, rows) + (tail if records else "")


def plot(records: list[dict[str, Any]], ax: Any) -> None:
    ax.bar([r["config"]["product"] for r in records], [median_of(r, "ratio") for r in records])
    if records:
        ax.axhline(1 / records[0]["config"]["ranks"], color="r", ls=":", label="ideal")
    ax.set(ylabel="share time / whole time", title="gemm split")
    ax.tick_params(axis="x", labelrotation=30, labelsize=7)
    ax.legend()
