"""What splitting the batch over ranks can give an MLP's matrix products, at best.

Data parallelism on N ranks runs each product of a training step with B / N rows instead of B.
This times every product of one step of the MLP (forward ``x @ W``, weight gradient
``x.T @ dz`` into a buffer, input gradient ``dz @ W.T`` for all but the first layer) with the
global batch and with one rank's share (the larger share where B does not divide), in cache,
at ``--threads`` BLAS threads (one, as each rank runs), and prints the share's time over the
whole batch's. An ideal split gives 1 / N. What is above it is the products' own loss of
efficiency at fewer rows, before any communication, update or stall: the inverse of the total
ratio bounds the speedup the products alone allow.

Samples alternate the two batch sizes (AB BA ...); a sample is the mean time of as many calls
as fill ``--seconds`` after a warm-up call (``time_wall``), and the table shows the median over
``--samples`` samples.

Run: ``python bench/gemm_split.py [--hidden 1024,1024] [--batch 128] [--ranks 2]``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial
from itertools import pairwise

from _common import (
    DefaultsFormatter,
    Parser,
    blas_threads,
    format_table,
    int_list,
    median,
    nonneg_float,
    positive_int,
    run_main,
    time_wall,
)

Product = tuple[str, str, Callable[[int], Callable[[], object]]]


def products(inputs: int, hidden: list[int], classes: int) -> list[Product]:
    """(name, shape, maker) for every product of one step; ``maker(n)`` builds the operands
    for a batch of ``n`` rows and returns the call to time."""
    import numpy as np

    rng = np.random.default_rng(0)

    def rand(*shape: int) -> np.ndarray:
        return rng.random(shape, dtype=np.float32)

    sizes = [inputs, *hidden, classes]
    out: list[Product] = []
    for i, (a, b) in enumerate(pairwise(sizes)):
        w = rand(a, b)
        grad = np.empty_like(w)  # the weight gradient lands in a buffer, as in Dense
        out.append(
            (f"layer {i} forward", f"B x {a} @ {a} x {b}",
             lambda n, a=a, w=w: partial(np.matmul, rand(n, a), w))
        )  # fmt: skip
        out.append(
            (f"layer {i} weight grad", f"{a} x B @ B x {b}",
             lambda n, a=a, b=b, g=grad: partial(np.matmul, rand(n, a).T, rand(n, b), out=g))
        )  # fmt: skip
        if i > 0:  # no input gradient for the data
            out.append(
                (f"layer {i} input grad", f"B x {b} @ {b} x {a}",
                 lambda n, b=b, w=w: partial(np.matmul, rand(n, b), w.T))
            )  # fmt: skip
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(
        prog="bench/gemm_split.py",
        description=__doc__.splitlines()[0],
        formatter_class=DefaultsFormatter,
    )
    a = ap.add_argument
    a("--hidden", type=int_list, default=[1024, 1024], help="hidden layer sizes")
    a("--inputs", type=positive_int, default=784, help="input features")
    a("--classes", type=positive_int, default=10, help="output units")
    a("--batch", type=positive_int, default=128, help="global batch")
    a("--ranks", type=positive_int, default=2, help="ranks the batch is split over")
    a("--threads", type=positive_int, default=1, help="BLAS threads (one per rank)")
    a("--samples", type=positive_int, default=7, help="timed samples per batch size")
    a("--seconds", type=nonneg_float, default=0.2, help="calls per sample fill this long")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.batch < args.ranks:
        ap.error(f"--batch {args.batch} is below --ranks {args.ranks}: a rank would get no rows")
    share = -(-args.batch // args.ranks)  # the slowest rank's rows
    rows = []
    totals = {args.batch: 0.0, share: 0.0}
    with blas_threads(args.threads):
        for name, shape, make in products(args.inputs, args.hidden, args.classes):
            calls = {b: make(b) for b in (args.batch, share)}
            samples: dict[int, list[float]] = {b: [] for b in calls}
            for s in range(args.samples):
                order = (args.batch, share) if s % 2 == 0 else (share, args.batch)
                for b in order:
                    samples[b].append(time_wall(calls[b], 1, min_sample_s=args.seconds)[0])
            whole, part = median(samples[args.batch]), median(samples[share])
            totals[args.batch] += whole
            totals[share] += part
            rows.append(
                [name, shape, f"{whole * 1e6:.0f}", f"{part * 1e6:.0f}", f"{part / whole:.3f}"]
            )
    ratio = totals[share] / totals[args.batch]
    rows.append(
        ["all", "", f"{totals[args.batch] * 1e6:.0f}", f"{totals[share] * 1e6:.0f}", f"{ratio:.3f}"]
    )
    sizes = "-".join(str(v) for v in (args.inputs, *args.hidden, args.classes))
    print(
        f"MLP {sizes}: each product at B = {args.batch} and at one rank's share B = {share} "
        f"({args.ranks} ranks), {args.threads} BLAS thread(s), in cache; median of "
        f"{args.samples} alternated samples, microseconds"
    )
    print(format_table(["product", "shape", f"B={args.batch}", f"B={share}", "ratio"], rows))
    print(
        f"\nideal ratio {1 / args.ranks:.3f}; the products alone allow a speedup of at most "
        f"{1 / ratio:.2f} on {args.ranks} ranks"
    )
    return 0


if __name__ == "__main__":
    run_main(main)
