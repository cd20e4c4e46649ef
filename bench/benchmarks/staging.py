"""Where a host-staged allreduce of a device buffer spends its time, phase by phase.

``--comm mpi-host`` with ``--backend cupy`` copies each gradient bucket device -> pinned host,
allreduces it in host memory, and copies it back. This times the three phases separately,
per buffer size, on every rank (after a barrier, one sample per call):

* get: ``dev.get(out=pinned, blocking=True)`` (device to pinned host, waited for);
* mpi: ``Allreduce(IN_PLACE)`` on the pinned buffer;
* set_sync: ``dev.set(pinned)`` then a stream synchronise (pinned host to device);
* raw_d2h: a bare ``cudaMemcpyAsync`` device to host plus synchronise, for comparison.

Two ranks sharing one GPU pay about 150 us for each small (<= 16 KiB) host-to-device copy,
against 10-20 us from 64 KiB up or with one rank (docs/gpu.md: the H100 and H200 machines).
Without CuPy or a CUDA device it says so in one line and records nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.core import markdown_table, median_of, record, run_worker
from bench.flags import distinct_int_list, positive_float, positive_int, rank_list

NAME = "staging"
SUMMARY = "a host-staged allreduce of device buffers, phase by phase (GPU)"
REPEATS = "iters"  # the flag counting its repeats
QUICK = {"iters": 20}
WORKER = "bench.benchmarks.staging"
PHASES = ("get", "mpi", "set_sync", "total", "raw_d2h")
WARMUP = 30


def add_arguments(p: argparse.ArgumentParser) -> None:

    sizes = [4, 4096, 16384, 65536, 262144, 1048576]
    p.add_argument("--ranks", type=rank_list, default=[1, 2], help="mpiexec -n, each in turn")
    p.add_argument("--sizes", type=distinct_int_list, default=sizes, help="buffer bytes")
    p.add_argument("--iters", type=positive_int, default=200, help="timed calls per size")
    p.add_argument("--timeout", type=positive_float, default=600, help="seconds allowed per run")


def gpu_problem() -> str | None:
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as exc:  # ImportError, or no driver
        return str(exc)
    return None


def run(args: argparse.Namespace, machine: dict[str, Any]) -> list[dict[str, Any]]:
    problem = gpu_problem()
    if problem:
        print(f"staging: skipped, CuPy/CUDA not usable ({problem})")
        return []
    out = []
    for ranks in args.ranks:
        sizes = ",".join(map(str, args.sizes))
        rows = run_worker(WORKER, ranks, [sizes, str(args.iters)], args.timeout)
        out += [record(NAME, config, samples, machine) for config, samples in rows]
    return out


def worker(out: str, sizes: list[int], iters: int) -> None:
    import cupy
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    cupy.cuda.Device(local.Get_rank() % cupy.cuda.runtime.getDeviceCount()).use()
    stream = cupy.cuda.get_current_stream()
    rows = []
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        dev = cupy.ones(n, cupy.float32)
        host = np.frombuffer(cupy.cuda.alloc_pinned_memory(n * 4), np.float32, n)
        us: dict[str, list[float]] = {f"{p}_us": [] for p in PHASES}
        for it in range(WARMUP + iters):
            comm.Barrier()
            t0 = time.perf_counter()
            dev.get(stream=stream, out=host, blocking=True)
            t1 = time.perf_counter()
            comm.Allreduce(MPI.IN_PLACE, host, MPI.SUM)
            t2 = time.perf_counter()
            dev.set(host, stream=stream)
            stream.synchronize()
            t3 = time.perf_counter()
            if it >= WARMUP:
                for key, t in zip(PHASES[:4], (t1 - t0, t2 - t1, t3 - t2, t3 - t0), strict=True):
                    us[f"{key}_us"].append(t * 1e6)
        kind = cupy.cuda.runtime.memcpyDeviceToHost
        for _ in range(iters):
            t0 = time.perf_counter()
            cupy.cuda.runtime.memcpyAsync(host.ctypes.data, dev.data.ptr, n * 4, kind, stream.ptr)
            stream.synchronize()
            us["raw_d2h_us"].append((time.perf_counter() - t0) * 1e6)
        rows.append(({"rank": rank, "ranks": size, "size_bytes": n * 4}, us))
    gathered = comm.gather(rows)
    if rank == 0:
        Path(out).write_text(json.dumps([row for rs in gathered for row in rs]))


def table(records: list[dict[str, Any]]) -> str:
    rows = [
        [r["config"]["ranks"], r["config"]["rank"], r["config"]["size_bytes"]]
        + [median_of(r, f"{p}_us") for p in PHASES]
        for r in records
    ]
    heads = ["ranks", "rank", "bytes", *(f"{p} µs" for p in PHASES)]
    return "medians over the timed calls\n\n" + markdown_table(heads, rows)


def plot(records: list[dict[str, Any]], ax: Any) -> None:
    """The host-to-device copy back (set_sync) by size: rank 0 of each run."""
    for ranks in sorted({r["config"]["ranks"] for r in records}):
        rs = [r for r in records if r["config"]["ranks"] == ranks and r["config"]["rank"] == 0]
        rs.sort(key=lambda r: r["config"]["size_bytes"])
        sizes = [r["config"]["size_bytes"] for r in rs]
        ax.plot(sizes, [median_of(r, "set_sync_us") for r in rs], "o-", label=f"{ranks} ranks")
    ax.set(xscale="log", yscale="log", xlabel="bytes", ylabel="µs (median)", title="set+sync")
    ax.legend(fontsize=7)


if __name__ == "__main__":
    worker(sys.argv[1], [int(s) for s in sys.argv[2].split(",")], int(sys.argv[3]))
