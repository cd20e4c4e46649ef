"""How a wait for a non-blocking allreduce is polled, and what it costs a large message.

MPI moves a message only while it is polled, and some libraries (Open MPI's non-blocking
collectives) only inside ``MPI_Test``/``MPI_Wait``. Under ``mpiexec -n RANKS`` (this module
launches itself) each size of host buffer is reduced, in turn, by the blocking
``MPI_Allreduce``, by ``MPI_Iallreduce`` then ``MPI_Wait``, and by ``MPI_Iallreduce`` polled
with ``MPI_Test`` in a tight loop, with ``sched_yield`` between tests, with a 50 µs sleep
between tests, and by xpnn's own wait (``xpnn.runtime.wait_polled``); the slowest rank's
median counts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench.core import markdown_table, median_of, record, run_worker, spread
from bench.flags import distinct_int_list, positive_float, positive_int, rank_count

NAME = "polling"
SUMMARY = "a non-blocking allreduce polled five ways vs blocking: what naps cost large messages"
REPEATS = "iters"  # the flag counting its repeats
QUICK = {"sizes": [1 << 18, 1 << 22], "iters": 5}
WORKER = "bench.benchmarks.polling"
METHODS = ("blocking", "wait", "spin", "yield", "nap50", "xpnn")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=rank_count, default=2)
    p.add_argument(
        "--sizes", type=distinct_int_list, default=[1 << 18, 1 << 22, 1 << 26], help="bytes"
    )
    p.add_argument("--iters", type=positive_int, default=10, help="timed calls per size and way")
    p.add_argument("--timeout", type=positive_float, default=900)


def run(args: argparse.Namespace, machine: dict[str, Any]) -> list[dict[str, Any]]:
    sizes = ",".join(map(str, args.sizes))
    rows = run_worker(WORKER, args.ranks, [sizes, str(args.iters)], args.timeout)
    return [
        record(NAME, {k: r[k] for k in ("size_bytes", "method", "ranks")},
               {"latency_us": r["latency_us"]}, machine)
        for r in rows
    ]  # fmt: skip


def _poll(method: str, request: Any) -> None:
    from xpnn.runtime import wait_polled

    if method == "wait":
        request.Wait()
    elif method == "xpnn":
        wait_polled(request, "an allreduce")
    else:
        pause = {"spin": None, "yield": os.sched_yield, "nap50": lambda: time.sleep(50e-6)}
        nap = pause[method]
        while not request.Test():
            if nap:
                nap()


def worker(out: str, sizes: str, iters: int) -> None:
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rows = []
    for size in (int(s) for s in sizes.split(",")):
        buf = np.ones(max(1, size // 8))
        times: dict[str, list[float]] = {m: [] for m in METHODS}
        for i in range(iters + 1):  # the first round warms up
            for method in METHODS if i % 2 == 0 else METHODS[::-1]:
                comm.Barrier()
                t0 = time.perf_counter()
                if method == "blocking":
                    comm.Allreduce(MPI.IN_PLACE, buf)
                else:
                    _poll(method, comm.Iallreduce(MPI.IN_PLACE, buf))
                if i:
                    times[method].append(time.perf_counter() - t0)
        for method, ts in times.items():  # every call kept, each the slowest rank's
            slowest = np.array(ts, dtype=np.float64)
            comm.Allreduce(MPI.IN_PLACE, slowest, op=MPI.MAX)
            rows.append({"size_bytes": size, "method": method, "ranks": comm.size,
                         "latency_us": (slowest * 1e6).tolist()})  # fmt: skip
    if comm.rank == 0:
        Path(out).write_text(json.dumps(rows))


def table(records: list[dict[str, Any]]) -> str:
    by = {(r["config"]["size_bytes"], r["config"]["method"]): r for r in records}
    sizes = sorted({s for s, _ in by})
    methods = [m for m in METHODS if any(m == k for _, k in by)]
    rows = [[s, *(spread(by[s, m], "latency_us") if (s, m) in by else None for m in methods)]
            for s in sizes]  # fmt: skip
    return markdown_table(["bytes", *(f"{m} µs" for m in methods)], rows)


def plot(records: list[dict[str, Any]], ax: Any) -> None:
    for method in METHODS:
        rs = sorted((r for r in records if r["config"]["method"] == method),
                    key=lambda r: r["config"]["size_bytes"])  # fmt: skip
        if rs:
            ax.plot([r["config"]["size_bytes"] for r in rs],
                    [median_of(r, "latency_us") for r in rs], "o-", label=method)  # fmt: skip
    ax.set(xscale="log", yscale="log", xlabel="bytes", ylabel="µs per allreduce", title=NAME)
    ax.legend(fontsize=7)


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2], int(sys.argv[3]))
