"""The README's Python loop against ``python -m xpnn`` on the same step.

The command line sets each rank's threads up (BLAS's and Numba's pools held to one count); a
Python program gets the same from its first ``get_backend``. The MLP 784-512-256-10 at batch
128 on synthetic data, each side in a fresh process, rounds alternated; a sample is the
second epoch's samples per second (the first compiles Numba's kernels).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from bench.core import record, run_command, run_xpnn, sides_bars, sides_table
from bench.flags import positive_int

NAME = "python_loop"
SUMMARY = "the README's Python loop vs python -m xpnn, samples/s (MLP 784-512-256-10)"
QUICK = {"samples": 1280, "rounds": 1}
SIDES = ("python -m xpnn", "Python loop")
BATCH = 128
HEAD = (
    "MLP 784-512-256-10, batch {batch}, {samples:,} synthetic samples, backend {backend}; "
    "samples/s of the second epoch, median (min–max) over rounds\n\n"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="numba", choices=["numpy", "numba", "torch"])
    p.add_argument("--samples", type=positive_int, default=12800, help="training samples")
    p.add_argument("--rounds", type=positive_int, default=3, help="alternated rounds")


def run(args: argparse.Namespace, machine: dict[str, Any]) -> list[dict[str, Any]]:
    rounds: dict[str, list[float]] = {s: [] for s in SIDES}
    for _ in range(args.rounds):  # alternate the sides: the machine's speed drifts
        flags = ["--backend", args.backend, "--dataset", "synthetic", "--synthetic-size"]
        flags += [str(args.samples), "--epochs", "2", "--batch-size", str(BATCH)]
        epochs = [m for m in run_xpnn(0, flags) if m.get("event") == "epoch"]
        rounds[SIDES[0]].append(epochs[-1]["samples_per_s"])
        cmd = [sys.executable, "-m", "bench.benchmarks.python_loop", args.backend]
        out = run_command([*cmd, str(args.samples)]).strip().splitlines()[-1]
        rounds[SIDES[1]].append(json.loads(out)["samples_per_s"])
    config = {"backend": args.backend, "samples": args.samples, "batch": BATCH}
    return [
        record(NAME, {"side": s, **config}, {"samples_per_s": v}, machine)
        for s, v in rounds.items()
    ]


def worker(backend_name: str, samples: int) -> dict[str, float]:
    """The README's loop, as written there, on the command line's synthetic data."""
    import numpy as np

    from xpnn.backends import get_backend
    from xpnn.data import load_dataset
    from xpnn.nn import Context, Dense, Flatten, Sequential
    from xpnn.train.optim import Schedule, make_optimizer

    backend = get_backend(backend_name)
    xp = backend.xp
    data = load_dataset("synthetic", synthetic_size=samples)
    model = Sequential([Flatten(), Dense(512, "relu"), Dense(256, "relu"), Dense(10)])
    model.build(data.input_shape, backend, seed=0)
    optimizer = make_optimizer("adam", model.params, model.grads, backend.kernels, Schedule(1e-3))
    seconds = 0.0
    for epoch in range(2):
        order = np.random.default_rng(epoch).permutation(len(data.y_train))
        start_time = time.perf_counter()
        for start in range(0, len(order), BATCH):
            batch = order[start : start + BATCH]
            x = backend.asarray(data.x_train[batch])
            y = backend.asarray(data.y_train[batch], dtype=xp.int64)
            model.loss_and_grads(x, y, Context(train=True), scale=1 / len(batch))
            optimizer.step()
        backend.synchronize()
        seconds = time.perf_counter() - start_time
    return {"samples_per_s": len(data.y_train) / seconds}


def table(records: list[dict[str, Any]]) -> str:
    return sides_table(records, "samples_per_s", "samples/s", HEAD)


def plot(records: list[dict[str, Any]], ax: Any) -> None:
    sides_bars(records, ax, "samples_per_s", ylabel="samples/s", title="the same step, two routes")


if __name__ == "__main__":
    print(json.dumps(worker(sys.argv[1], int(sys.argv[2]))))
