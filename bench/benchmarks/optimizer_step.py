"""How long one optimizer update takes, per backend and against PyTorch.

The optimizer touches every parameter every step; for a small MLP on two cores that is a large
share of the step, so it is worth timing alone. Each side runs in a fresh process (PyTorch's
OpenMP pool and Numba's must not share one: the first one loaded sets the wait policy), rounds
alternate between the sides, and a round's sample is the median over its calls.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.core import BenchError, record, run_command, sides_bars, sides_table
from bench.flags import choice_list, positive_float, positive_int

NAME = "optimizer_step"
SUMMARY = "one optimizer update: NumPy vs Numba vs PyTorch, microseconds"
REPEATS = "rounds"  # the flag counting its repeats
QUICK = {"params": 100_000, "rounds": 1, "calls": 5, "sides": ["numpy"]}
SIDES = ("numpy", "numba", "torch")
WORKER = "bench.benchmarks.optimizer_step"
HEAD = (
    "{optimizer} update of {params:,} float32 parameters, {threads} threads, {calls} calls a "
    "round; median (min–max) over rounds\n\n"
)


def add_arguments(p: argparse.ArgumentParser) -> None:

    p.add_argument("--params", type=positive_int, default=535818, help="MLP 784-512-256-10's")
    p.add_argument("--optimizer", default="adam", choices=["sgd", "momentum", "adam"])
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--rounds", type=positive_int, default=5, help="alternated rounds")
    p.add_argument("--calls", type=positive_int, default=200, help="timed updates per round")
    p.add_argument("--sides", type=choice_list(SIDES), default=list(SIDES), help=",".join(SIDES))
    p.add_argument("--timeout", type=positive_float, default=600, help="seconds allowed per worker")


def run(args: argparse.Namespace, machine: dict[str, Any]) -> list[dict[str, Any]]:
    sides, info = list(args.sides), {}
    if "torch" in sides and importlib.util.find_spec("torch") is None:
        info["torch_skipped"] = "PyTorch is not installed (pip install torch==2.13.0)"
        sides.remove("torch")
        if not sides:  # nothing to time
            raise BenchError(f"--sides torch: {info['torch_skipped']}")
        print(f"torch side skipped: {info['torch_skipped']}")
    need, free = args.params * BYTES_PER_PARAM, available_memory()
    if free is not None and need > free // 2:
        raise BenchError(
            f"--params {args.params}: needs about {need / 2**30:.1f} GiB (parameters, gradients "
            f"and state in float64), more than half of the {free / 2**30:.1f} GiB available"
        )
    settings = [str(v) for v in (args.params, args.optimizer, args.threads, args.calls)]
    rounds: dict[str, list[float]] = {s: [] for s in sides}
    for _ in range(args.rounds):  # alternate the sides: the machine's speed drifts
        for side in sides:
            cmd = [sys.executable, "-m", WORKER, side, *settings]
            result = json.loads(run_command(cmd, args.timeout).strip().splitlines()[-1])
            if "out_of_memory" in result:
                raise BenchError(
                    f"--params {args.params}: too many for memory on the {side} side "
                    f"({result['out_of_memory']})"
                )
            rounds[side].append(result["us"])
    config = {"optimizer": args.optimizer, "params": args.params, "threads": args.threads}
    config["calls"] = args.calls
    return [
        record(NAME, {"side": s, **config}, {"us_per_update": us}, machine, info)
        for s, us in rounds.items()
    ]


BYTES_PER_PARAM = 8 * 6  # float64 parameters, gradients, two moments and the update's temporaries


def available_memory() -> int | None:
    """Bytes of memory available now (``/proc/meminfo``'s MemAvailable), None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def worker(side: str, params: int, optimizer: str, threads: int, calls: int) -> dict[str, Any]:
    """Median microseconds of one update in this process, or why memory ran out."""
    try:
        step = _make_step(side, params, optimizer, threads)
    except MemoryError as exc:
        return {"out_of_memory": f"MemoryError: {exc}"}
    except RuntimeError as exc:  # PyTorch's CPU allocator says it so
        if "can't allocate memory" not in str(exc):
            raise
        return {"out_of_memory": f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1]}"}
    for _ in range(10):
        step()
    samples = []
    for _ in range(calls):
        t = time.perf_counter()
        step()
        samples.append((time.perf_counter() - t) * 1e6)
    return {"us": statistics.median(samples)}


def _make_step(side: str, params: int, optimizer: str, threads: int) -> Any:
    if side == "torch":
        import torch

        torch.set_num_threads(threads)
        p = torch.nn.Parameter(torch.rand(params))
        p.grad = torch.rand(params)
        cls = {"sgd": torch.optim.SGD, "momentum": torch.optim.SGD, "adam": torch.optim.Adam}
        kw = {"momentum": 0.9} if optimizer == "momentum" else {}
        return cls[optimizer]([p], lr=1e-3, **kw).step
    from xpnn.runtime import apply_threads

    apply_threads(threads)  # before NumPy's BLAS and Numba start their pools
    import numpy as np

    from xpnn.backends import get_backend
    from xpnn.train.optim import Schedule, make_optimizer

    backend = get_backend(side)
    rng = np.random.default_rng(0)
    p = backend.asarray(rng.random(params))
    g = backend.asarray(rng.random(params))
    return make_optimizer(optimizer, p, g, backend.kernels, Schedule(1e-3)).step


def table(records: list[dict[str, Any]]) -> str:
    return sides_table(records, "us_per_update", "µs per update", HEAD)


def plot(records: list[dict[str, Any]], ax: Any) -> None:
    title = f"{records[0]['config']['optimizer']} update"
    sides_bars(records, ax, "us_per_update", ylabel="µs per update", title=title)


if __name__ == "__main__":
    side, params, opt, threads, calls = sys.argv[1:6]
    print(json.dumps(worker(side, int(params), opt, int(threads), int(calls))))
