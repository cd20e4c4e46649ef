"""What ``--trace`` costs a training step: the same data-parallel run with tracing off and with
every step traced (``--trace-steps 0:N``), alternated off/on, on/off, ..., the median of each
run's steady epochs compared; and, timed in this process, what a trace point and the flight
recorder's record of one operation cost while tracing is off."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.core import markdown_table, median_of, record, spread
from bench.flags import positive_int, rank_count
from bench.training import add_data_arguments, command, data_flags, timed_run
from xpnn.record import phases
from xpnn.runtime import flight
from xpnn.train import Trace

NAME = "trace_cost"
SUMMARY = "--trace off vs on: seconds per epoch, alternated; the cost of a trace point when off"
QUICK = {"samples": 1024, "hidden": "128", "epochs": 2, "repeats": 2}
ALL_STEPS = "0:1000000000"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_data_arguments(p, samples=6400)
    p.set_defaults(repeats=5)
    p.add_argument("--ranks", type=rank_count, default=2)
    p.add_argument("--hidden", default="1024,1024")
    p.add_argument("--batch-size", type=positive_int, default=256, help="global batch")
    p.add_argument("--epochs", type=positive_int, default=3)
    p.add_argument("--comm", default="mpi-host")
    p.add_argument("--bucket-mb", default="1")


def off_costs(calls: int = 200_000) -> dict[str, list[float]]:
    """Nanoseconds of a layer's trace point (tracing off, on) and of one flight record."""

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
    trace = Trace("unused")  # a span recorded while tracing is on
    trace.rank = 0
    t0 = time.perf_counter()
    for _ in range(calls // 10):
        with trace.span("forward", phases.COMPUTE):
            pass
    per_on = (time.perf_counter() - t0) / (calls // 10)
    ns = {"span_off_ns": per_span, "flight_op_ns": per_op, "span_on_ns": per_on}
    return {key: [value * 1e9] for key, value in ns.items()}


def events_per_step(directory: str) -> float:
    """Spans a traced step recorded on rank 0 (its trace file's spans over its steps)."""
    events = json.loads((Path(directory) / "trace-rank0.json").read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    return len(spans) / max(1, sum(e["cat"] == "step" for e in spans))


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
                samples[mode].setdefault("steps_per_epoch", []).append(
                    args.samples / args.batch_size
                )
        samples["on"]["spans_per_step"] = [events_per_step(tmp)]
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
        off = by["off"]
        text += (
            f"\n\nTimed in one process: a trace point took {median_of(off, 'span_off_ns'):.0f} "
            f"ns with tracing off and {median_of(off, 'span_on_ns'):.0f} ns with it on; the "
            f"flight record of one operation {median_of(off, 'flight_op_ns'):.0f} ns."
        )
        spans = median_of(by["on"], "spans_per_step") if "on" in by else None
        steps = median_of(off, "steps_per_epoch")
        if spans and steps and base:
            share = spans * median_of(off, "span_on_ns") * 1e-9 / (base / steps)
            text += (
                f" A traced step recorded {spans:.0f} spans: at that cost, "
                f"{100 * share:.2f} % of a step of {1e3 * base / steps:.1f} ms."
            )
    return text


def plot(records: list[dict[str, Any]], ax: Any) -> None:
    modes = [m for m in ("off", "on") if any(r["config"]["trace"] == m for r in records)]
    by = {r["config"]["trace"]: r for r in records}
    ax.bar(modes, [median_of(by[m], "epoch_s") for m in modes], color="C0")
    ax.set(xlabel="--trace", ylabel="seconds per epoch (median)", title=NAME)
