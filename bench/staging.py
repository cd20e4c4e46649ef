"""Where a host-staged allreduce of a device buffer spends its time, phase by phase.

``--comm mpi-host`` with ``--backend cupy`` copies each gradient bucket device -> pinned host,
allreduces it in host memory, and copies it back. This times the three phases separately,
per buffer size, on every rank (after a barrier, median over ``--iters`` calls):

* get: ``dev.get(out=pinned, blocking=True)`` (device to pinned host, waited for);
* mpi: ``Allreduce(IN_PLACE)`` on the pinned buffer;
* set+sync: ``dev.set(pinned)`` then a stream synchronise (pinned host to device);
* raw d2h: a bare ``cudaMemcpyAsync`` device to host plus synchronise, for comparison.

On the H100 machine (docs/gpu.md) it showed that two ranks sharing one GPU pay 150-300 us for
each small (<= 16 KiB) host-to-device copy, against about 15 us from 64 KiB up or with one rank.

Run: ``mpiexec -n 2 python bench/staging.py`` (and ``-n 1`` to compare). Without CuPy or a
CUDA device it says so in one line and exits 0.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
from _common import Parser, distinct_int_list, launch_rank, positive_int, run_main

DEFAULT_SIZES = "4,4096,16384,65536,262144,1048576"
WARMUP = 30


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--sizes", type=distinct_int_list, default=DEFAULT_SIZES, help=f"bytes ({DEFAULT_SIZES})"
    )
    p.add_argument("--iters", type=positive_int, default=200, help="timed calls per size")
    args = p.parse_args(argv)
    try:
        import cupy

        gpus = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # ImportError, or no driver / device
        if launch_rank() == 0:  # MPI is not started: the launcher's rank says who speaks
            print(f"staging: skipped, CuPy/CUDA not usable ({exc})")
        return 0
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    cupy.cuda.Device(local.Get_rank() % gpus).use()
    stream = cupy.cuda.get_current_stream()
    lines = []
    for nbytes in args.sizes:
        n = max(1, nbytes // 4)
        dev = cupy.ones(n, cupy.float32)
        host = np.frombuffer(cupy.cuda.alloc_pinned_memory(n * 4), np.float32, n)
        phases: dict[str, list[float]] = {"get": [], "mpi": [], "set+sync": [], "total": []}
        for it in range(WARMUP + args.iters):
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
                for key, t in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t3 - t0), strict=True):
                    phases[key].append(t)
        raw = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            kind = cupy.cuda.runtime.memcpyDeviceToHost
            cupy.cuda.runtime.memcpyAsync(host.ctypes.data, dev.data.ptr, n * 4, kind, stream.ptr)
            stream.synchronize()
            raw.append(time.perf_counter() - t0)
        med = {k: statistics.median(v) * 1e6 for k, v in phases.items()}
        lines.append(
            f"rank {rank}/{size} {n * 4:>9} B  get {med['get']:7.1f}  mpi {med['mpi']:7.1f}  "
            f"set+sync {med['set+sync']:7.1f}  total {med['total']:7.1f}  "
            f"raw d2h {statistics.median(raw) * 1e6:6.1f}  (us, medians)"
        )
    for text in comm.gather("\n".join(lines)) or []:
        print(text)
    return 0


if __name__ == "__main__":
    run_main(main)
