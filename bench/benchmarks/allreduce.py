"""Allreduce latency and bandwidth: xpnn's communicator against a raw mpi4py Allreduce.

Run under ``mpiexec -n RANKS`` (this module launches itself); each size is timed alternately
through xpnn's communicator (host buffers; with ``--device`` CuPy buffers too) and the raw
``MPI.COMM_WORLD.Allreduce`` on the same buffer, the slowest rank's median counting. The
overhead is xpnn's time over raw MPI's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench.core import markdown_table, median_of, record, run_worker, spread
from bench.flags import message_size, positive_float, positive_int, rank_count

NAME = "allreduce"
SUMMARY = "allreduce latency and bandwidth: xpnn's comm vs raw MPI, host and device buffers"
COMMS = ("auto", "mpi-shm", "mpi-host", "mpi-cuda", "nccl")  # xpnn --comm's, "self" aside
REPEATS = "iters"  # the flag counting its repeats
QUICK = {"max_size": 1 << 20, "iters": 20}
WORKER = "bench.benchmarks.allreduce"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=rank_count, default=2)
    p.add_argument(
        "--max-size",
        type=message_size,
        default=64 << 20,
        help="largest message, bytes (4 at least)",
    )
    p.add_argument("--iters", type=positive_int, default=50, help="timed calls per size")
    p.add_argument("--comm", default="auto", choices=COMMS, help="xpnn --comm for host buffers")
    p.add_argument("--device", action="store_true", help="also CuPy buffers (needs a GPU)")
    p.add_argument(
        "--device-comms",
        default="auto",
        help="--comm kinds for device buffers, comma-separated (e.g. mpi-cuda,mpi-host,nccl)",
    )
    p.add_argument("--timeout", type=positive_float, default=900)


def sizes(max_size: int) -> list[int]:
    out, s = [], 4
    while s <= max_size:
        out.append(s)
        s *= 16
    return out


def run(args: argparse.Namespace, machine: dict[str, Any]) -> list[dict[str, Any]]:
    device = args.device_comms if args.device else ""
    flags = [str(args.max_size), str(args.iters), args.comm, device]
    rows = run_worker(WORKER, args.ranks, flags, args.timeout)
    records = []
    for r in rows:
        config = {k: r[k] for k in ("size_bytes", "comm", "buffers", "ranks")}
        samples = {"latency_us": r["latency_us"], "raw_latency_us": r["raw_latency_us"]}
        records.append(record(NAME, config, {k: v for k, v in samples.items() if v}, machine))
    return records


def _time(comm: Any, ops: dict[str, Any], iters: int) -> dict[str, list[float]]:
    """Seconds of every timed call of each op, alternating their order; each call the
    slowest rank's (every repeat kept: the records show the spread)."""
    import numpy as np
    from mpi4py import MPI

    out: dict[str, list[float]] = {k: [] for k in ops}
    for i in range(iters + 3):
        for name in list(ops) if i % 2 == 0 else list(ops)[::-1]:
            comm.Barrier()
            t0 = time.perf_counter()
            ops[name]()
            if i >= 3:
                out[name].append(time.perf_counter() - t0)
    slowest = {}
    for k, v in out.items():
        arr = np.array(v, dtype=np.float64)
        comm.Allreduce(MPI.IN_PLACE, arr, op=MPI.MAX)
        slowest[k] = arr.tolist()
    return slowest


def worker(out: str, max_size: int, iters: int, comm_kind: str, device: str) -> None:
    """``device``: the comma-separated --comm kinds to time on CuPy buffers ("": none). A kind
    that cannot run here falls back as training would, and the row names what ran."""
    import numpy as np
    from mpi4py import MPI

    from xpnn.parallel.comm import make_communicator
    from xpnn.runtime import init_world

    world = init_world()
    raw = MPI.COMM_WORLD
    backend = SimpleNamespace(name="numpy", is_gpu=False, xp=np)
    comm = make_communicator(world, backend, comm_kind if world.size > 1 else "mpi-host")
    kinds = [("host", np, comm)]
    if device:
        import cupy

        dev = SimpleNamespace(name="cupy", is_gpu=True, xp=cupy)
        for kind in device.split(","):
            kinds.append(("device", cupy, make_communicator(world, dev, kind)))
    rows = []
    for buffers, xp, c in kinds:
        for nbytes in sizes(max_size):
            buf = xp.zeros(nbytes // 4, dtype=xp.float32)
            ops = {"xpnn": lambda c=c, buf=buf: c.allreduce_(buf)}
            if buffers == "host":
                ops["raw"] = lambda buf=buf: raw.Allreduce(MPI.IN_PLACE, buf)
            t = _time(raw, ops, iters)
            rows.append({
                "size_bytes": nbytes, "comm": c.name, "buffers": buffers, "ranks": world.size,
                "latency_us": [x * 1e6 for x in t["xpnn"]],
                "raw_latency_us": [x * 1e6 for x in t["raw"]] if "raw" in t else None,
            })  # fmt: skip
    if world.rank == 0:
        Path(out).write_text(json.dumps(rows))


def table(records: list[dict[str, Any]]) -> str:
    rows = []
    for r in sorted(records, key=lambda r: (r["config"]["buffers"], r["config"]["size_bytes"])):
        c, t, raw = r["config"], median_of(r, "latency_us"), median_of(r, "raw_latency_us")
        bw = c["size_bytes"] / (t * 1e-6) / 1e9
        rows.append([c["size_bytes"], c["buffers"], c["comm"], spread(r, "latency_us"),
                     spread(r, "raw_latency_us"), raw and t / raw, bw])  # fmt: skip
    heads = ["bytes", "buffers", "comm", "xpnn µs", "raw MPI µs", "overhead", "GB/s (alg)"]
    return markdown_table(heads, rows)


def plot(records: list[dict[str, Any]], ax: Any) -> None:
    """A line per buffer kind and transport (each its own curve, never joined)."""
    for buffers, comm in sorted({(r["config"]["buffers"], r["config"]["comm"]) for r in records}):
        rs = sorted(
            (
                r
                for r in records
                if (r["config"]["buffers"], r["config"]["comm"]) == (buffers, comm)
            ),
            key=lambda r: r["config"]["size_bytes"],
        )
        ax.plot(
            [r["config"]["size_bytes"] for r in rs],
            [median_of(r, "latency_us") for r in rs],
            "o-",
            label=f"{buffers} buffers, {comm}",
        )
    ax.set(xscale="log", yscale="log", xlabel="bytes", ylabel="µs per allreduce", title="allreduce")
    ax.legend(fontsize=8)


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
