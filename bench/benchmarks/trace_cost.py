"""What ``--trace`` costs a training step: the same data-parallel run with tracing off and with
every step traced (``--trace-steps 0:N``), alternated off/on, on/off, ..., the median of each
run's steady epochs compared; and, timed in this process, what a trace point and the flight
recorder's record of one operation cost while tracing is off."""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

from bench.core import markdown_table, median_of, record, spread
from bench.training import add_data_arguments, command, data_flags, timed_run

NAME = "trace_cost"
SUMMARY = "--trace off vs on: seconds per epoch, alternated; the cost of a trace point when off"
QUICK = {"samples": 1024, "hidden": "128", "epochs": 2, "repeats": 2}
ALL_STEPS = "0:1000000000"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_data_arguments(p, samples=6400)
    p.set_defaults(repeats=5)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--hidden", default="1024,1024")
    p.add_argument("--batch-size", type=int, default=256, help="global batch")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--comm", default="mpi-host")
    p.add_argument("--bucket-mb", default="1")


def off_costs(calls: int = 200_000) -> dict[str, list[float]]:
    """Nanoseconds of a layer's trace point and of one flight record, tracing off."""
    from xpnn import phases
    from xpnn.runtime import flight

    class Comm:
        size = 2

    span = phases.layer_span
    t0 = time.perf_counter()
    for _ in range(calls):
        with span("forward", 0, None):
            pass
    per_span = (time.perf_counter() - t0) / calls
    comm = Comm()
    t0 = time.perf_counter()
    for _ in range(calls // 10):
        with flight.Op(comm, "allreduce", 8):
            pass
    per_op = (time.perf_counter() - t0) / (calls // 10)
    flight.clear()
    return {"span_off_ns": [per_span * 1e9], "flight_op_ns": [per_op * 1e9]}


def run(args: argparse.Namespace, machine: dict[str, Any]) -> list[dict[str, Any]]:
    flags = [
        "--model", "mlp", "--hidden", args.hidden, "--optimizer", "sgd", "--lr", "0.05",
        "--batch-size", str(args.batch_size), "--epochs", str(args.epochs), *data_flags(args),
        "--comm", args.comm, "--bucket-mb", args.bucket_mb,
    ]  # fmt: skip
    samples: dict[str, dict[str, list[float]]] = {"off": {}, "on": {}}
    with tempfile.TemporaryDirectory(prefix="xpnn-trace-cost-") as tmp:
        runs = {"off": flags, "on": [*flags, "--trace", tmp, "--trace-steps", ALL_STEPS]}
        for i in range(args.repeats):
            for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
                numbers = timed_run(args.ranks, runs[mode], args)
                samples[mode].setdefault("epoch_s", []).append(numbers["epoch_s"])
    samples["off"].update(off_costs())
    out = []
    for mode, measured in samples.items():
        config = {
            "trace": mode, "ranks": args.ranks, "hidden": args.hidden, "threads": args.threads,
            "batch_size": args.batch_size, "epochs": args.epochs, "comm": args.comm,
            "bucket_mb": args.bucket_mb, "dataset": args.dataset,
            "command": command(args.ranks, runs[mode], args),
        }  # fmt: skip
        out.append(record(NAME, config, measured, machine))
    return out


def table(records: list[dict[str, Any]]) -> str:
    by = {r["config"]["trace"]: r for r in records}
    base = median_of(by["off"], "epoch_s") if "off" in by else None
    rows = []
    for mode in ("off", "on"):
        if mode in by:
            t = median_of(by[mode], "epoch_s")
            rows.append([mode, spread(by[mode], "epoch_s"), base and 100 * (t / base - 1)])
    text = markdown_table(["--trace", "epoch s", "cost vs off %"], rows)
    if "off" in by and "span_off_ns" in by["off"]["metrics"]:
        text += (
            f"\n\nWith tracing off a trace point took {median_of(by['off'], 'span_off_ns'):.0f} "
            f"ns and the flight record of one operation {median_of(by['off'], 'flight_op_ns'):.0f}"
            " ns (timed in one process)."
        )
    return text


def plot(records: list[dict[str, Any]], ax: Any) -> None:
    modes = [m for m in ("off", "on") if any(r["config"]["trace"] == m for r in records)]
    by = {r["config"]["trace"]: r for r in records}
    ax.bar(modes, [median_of(by[m], "epoch_s") for m in modes], color="C0")
    ax.set(xlabel="--trace", ylabel="seconds per epoch (median)", title=NAME)
