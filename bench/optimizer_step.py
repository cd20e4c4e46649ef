"""How long one optimizer update takes, per backend and against PyTorch.

The optimizer touches every parameter every step; for a small MLP on two cores that is a large
share of the step, so it is worth timing alone. Each side runs in its own process (PyTorch's
OpenMP pool and Numba's must not share one: the first one loaded sets the wait policy), rounds
alternate between the sides, and the table shows the median over rounds of each round's median.

Run: ``python bench/optimizer_step.py [--params 535818] [--optimizer adam] [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from _common import (
    Parser,
    choice_list,
    format_table,
    median,
    out_path,
    positive_int,
    refuse_unwritable,
    run_main,
    write_json,
)

SIDES = ("numpy", "numba", "torch")
WORKER_TIMEOUT_S = 600
OUT_OF_MEMORY = 3  # a worker's exit status when the parameters did not fit


class SideFailed(Exception):
    """A side's worker process failed; ``code`` is this script's exit status for it."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def time_side(side: str, params: int, optimizer: str, threads: int, calls: int) -> float:
    """Median microseconds of one update, measured in a fresh process (``--worker``). A worker
    that fails is ``SideFailed``, with the last line of its own error."""
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        side,
        "--params",
        str(params),
        "--optimizer",
        optimizer,
        "--threads",
        str(threads),
        "--calls",
        str(calls),
    ]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SideFailed(
            f"--sides {side}: the worker took more than {WORKER_TIMEOUT_S} s; "
            "try fewer --params or --calls",
            1,
        ) from None
    lines = (out.stderr or out.stdout).strip().splitlines()
    last = lines[-1] if lines else "no output"
    if out.returncode == OUT_OF_MEMORY:
        raise SideFailed(f"--params {params}: too many for memory on the {side} side ({last})", 2)
    if out.returncode != 0:
        raise SideFailed(f"--sides {side}: the worker failed (exit {out.returncode}): {last}", 1)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["us"])


def worker_main(side: str, params: int, optimizer: str, threads: int, calls: int) -> int:
    """``worker``, with running out of memory told apart: one line and ``OUT_OF_MEMORY``."""
    try:
        worker(side, params, optimizer, threads, calls)
    except MemoryError as exc:
        print(f"MemoryError: {exc}", file=sys.stderr)
        return OUT_OF_MEMORY
    except RuntimeError as exc:  # PyTorch's CPU allocator says it so
        if "can't allocate memory" not in str(exc):
            raise
        print(f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1]}", file=sys.stderr)
        return OUT_OF_MEMORY
    return 0


def worker(side: str, params: int, optimizer: str, threads: int, calls: int) -> None:
    import time

    if side == "torch":
        import torch

        torch.set_num_threads(threads)
        p = torch.nn.Parameter(torch.rand(params))
        p.grad = torch.rand(params)
        cls = {"sgd": torch.optim.SGD, "momentum": torch.optim.SGD, "adam": torch.optim.Adam}
        kw = {"momentum": 0.9} if optimizer == "momentum" else {}
        step = cls[optimizer]([p], lr=1e-3, **kw).step
    else:
        from xpnn.runtime import apply_threads

        apply_threads(threads)
        import numpy as np

        from xpnn.backends import get_backend
        from xpnn.optim import Schedule, make_optimizer

        backend = get_backend(side)
        rng = np.random.default_rng(0)
        p = backend.asarray(rng.random(params))
        g = backend.asarray(rng.random(params))
        step = make_optimizer(optimizer, p, g, backend.kernels, Schedule(1e-3)).step
    for _ in range(10):
        step()
    samples = []
    for _ in range(calls):
        t = time.perf_counter()
        step()
        samples.append((time.perf_counter() - t) * 1e6)
    print(json.dumps({"us": median(samples)}))


def main() -> int:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--params", type=positive_int, default=535818, help="parameters (MLP 784-512-256-10)"
    )
    ap.add_argument("--optimizer", default="adam", choices=["sgd", "momentum", "adam"])
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--rounds", type=positive_int, default=5)
    ap.add_argument("--calls", type=positive_int, default=200, help="timed updates per round")
    ap.add_argument(
        "--sides",
        type=choice_list(SIDES),
        default=list(SIDES),
        help=f"comma list among {','.join(SIDES)} (default: all)",
    )
    ap.add_argument("--json", type=out_path, default=None)
    ap.add_argument("--worker", choices=SIDES, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker_main(args.worker, args.params, args.optimizer, args.threads, args.calls)
    if args.json is not None:
        refuse_unwritable(ap, "--json", args.json)
    sides = list(args.sides)
    if "torch" in sides and importlib.util.find_spec("torch") is None:
        why = "PyTorch is not installed (pip install torch==2.13.0)"
        sides.remove("torch")
        if not sides:  # nothing to time: say so, write nothing
            print(f"{ap.prog}: error: --sides torch: {why}", file=sys.stderr)
            return 2
        print(f"torch side skipped: {why}")
    results: dict[str, list[float]] = {s: [] for s in sides}
    for _ in range(args.rounds):  # alternate the sides: the machine's speed drifts
        for side in sides:
            try:
                us = time_side(side, args.params, args.optimizer, args.threads, args.calls)
            except SideFailed as exc:
                print(f"{ap.prog}: error: {exc}", file=sys.stderr)
                return exc.code
            results[side].append(us)
    rows = [[s, f"{median(v):.1f}", f"{min(v):.1f}-{max(v):.1f}"] for s, v in results.items()]
    print(
        f"{args.optimizer} update of {args.params:,} float32 parameters, {args.threads} threads, "
        f"median of {args.rounds} alternated rounds x {args.calls} calls"
    )
    print(format_table(["side", "us per update", "round medians min-max"], rows))
    if args.json:
        write_json(
            args.json,
            {
                "args": {
                    k: str(v) if isinstance(v, Path) else v
                    for k, v in vars(args).items()
                    if k != "worker"  # this script's own, not a setting
                },
                "us": {s: median(v) for s, v in results.items()},
                "rounds": results,
            },
        )
    return 0


if __name__ == "__main__":
    run_main(main)
