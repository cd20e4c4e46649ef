"""Under ``mpiexec -n R``: collectives' and a shared exchange's ``t = alpha + beta * bytes``, R
ranks' crowding and phases between fences (docs/planning.md); rank 0 prints one JSON line."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial

import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_limits

from xpnn.parallel.comm.shm import ShmCommunicator

OPS = ("allreduce", "reduce_scatter", "allgather", "bcast", "sendrecv")


def _time(comm, run, repeats: int) -> float:  # noqa: ANN001
    samples = []
    for _ in range(repeats):
        comm.Barrier()
        samples.append(_clock(run))
    return float(comm.allreduce(statistics.median(samples), op=MPI.MAX))


def _op(comm, name: str, values: int):  # noqa: ANN001, ANN202
    size, rank = comm.Get_size(), comm.Get_rank()
    send = np.ones(values, dtype=np.float32)
    recv = np.empty(values, dtype=np.float32)
    if name == "allreduce":
        return lambda: comm.Allreduce(send, recv)
    if name == "reduce_scatter":
        part = np.empty(values // size, dtype=np.float32)
        return lambda: comm.Reduce_scatter_block(send[: part.size * size], part)
    if name == "allgather":
        part = send[: values // size]
        whole = np.empty(part.size * size, dtype=np.float32)
        return lambda: comm.Allgather(part, whole)
    if name == "bcast":
        return lambda: comm.Bcast(send, root=0)
    peer = rank ^ 1
    if peer >= size:  # an odd rank count: the last rank has no partner and waits
        return lambda: None
    return lambda: comm.Sendrecv(send, peer, recvbuf=recv, source=peer)


def _fit(points: list[tuple[float, float]]) -> list[float]:
    """[alpha, beta] through (bytes, seconds), weighted by relative error, neither below 0."""
    nbytes, seconds = (np.array(v, dtype=np.float64) for v in zip(*points, strict=True))
    beta, alpha = np.polyfit(nbytes, seconds, 1, w=1.0 / seconds)
    return [max(float(alpha), 0.0), max(float(beta), 0.0)]


def shared_exchange(comm, exponents: range, repeats: int) -> list[float]:  # noqa: ANN001
    """[alpha, beta] of a node-shared exchange: write a share, the run's fence, read the others'."""
    shm = ShmCommunicator.create(comm)
    points = []
    for e in exponents:
        values = max(shm.local_size, (1 << e) // 4)
        run, others = _exchange(shm, shm.shared_zeros(values, np.float32))
        run()
        points.append((4.0 * others, _time(comm, run, repeats)))
        shm.free()
    return _fit(points)


def _exchange(shm, shared: np.ndarray):  # noqa: ANN001, ANN202
    """(one exchange over ``shared``, the values the other ranks write in it)."""
    size, rank = shm.local_size, shm.local_rank
    lo, hi = rank * shared.size // size, (rank + 1) * shared.size // size
    mine = np.ones(hi - lo, dtype=shared.dtype)

    def run() -> None:
        shared[lo:hi] = mine
        shm.fence()
        shared[:lo].sum()
        shared[hi:].sum()

    return run, shared.size - (hi - lo)


CROWD_PRODUCTS = 200  # about 60 ms of one core on the 2-core EPYC


def crowding(comm, repeats: int) -> float:  # noqa: ANN001
    """Per-rank time of a one-thread product run by every rank at once over rank 0's alone."""
    a = np.random.default_rng(comm.Get_rank()).standard_normal((192, 192)).astype(np.float32)

    def work() -> None:  # tens of scheduler time slices: which rank waits one more is noise
        for _ in range(CROWD_PRODUCTS):
            a @ a

    with threadpool_limits(limits=1):  # each rank one thread, as ranks of one thread run
        alone, together = _alone_and_together(comm, work, work, repeats)
    return max(1.0, together / alone)


PHASE_PRODUCTS = (4, 16, 64, 256)  # of 96 x 96 (tens of us each) between two fences
PHASE_TOTAL = 512  # products a sample runs (at least 8 phases): many fences, several slices


def phases(comm, repeats: int) -> list[list[float]]:  # noqa: ANN001
    """[[s of products alone between two fences, s of the phase with every rank fencing], ...]:
    a synchronization's cost to ranks sharing cores depends on the compute between two."""
    shm = ShmCommunicator.create(comm)
    a = np.random.default_rng(comm.Get_rank()).standard_normal((96, 96)).astype(np.float32)

    def run(products: int, count: int, fence: bool) -> None:
        for _ in range(count):
            for _ in range(products):
                a @ a
            if fence:
                shm.fence()

    out = []
    with threadpool_limits(limits=1):
        for products in PHASE_PRODUCTS:
            count = max(8, PHASE_TOTAL // products)
            runs = (partial(run, products, count, fence) for fence in (False, True))
            alone, together = _alone_and_together(comm, *runs, repeats)
            out.append([alone / count, together / count])
    shm.free()
    return out


def _alone_and_together(comm, alone, together, repeats: int) -> tuple[float, float]:  # noqa: ANN001
    """(rank 0's fastest ``alone()``, others asleep; the slowest rank's median ``together()``)."""
    first = 0.0
    if comm.Get_rank() == 0:
        alone()
        first = min(_clock(alone) for _ in range(repeats))
    request = comm.Ibarrier()  # MPI's own barrier spins: rank 0 alone would share its core
    while not request.Test():
        time.sleep(0.001)
    together()
    both = statistics.median(_clock(together) for _ in range(repeats))
    return comm.bcast(first, root=0), comm.allreduce(both, op=MPI.MAX)


def _clock(run) -> float:  # noqa: ANN001
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m xpnn.planner.probe")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    exponents = range(10, 25, 3) if args.quick else range(8, 26, 2)  # 256 B .. 32 MiB
    repeats = 3 if args.quick else 7
    fits = {}
    for name in OPS:
        points = []
        for e in exponents:
            values = max(size, (1 << e) // 4)
            run = _op(comm, name, values)
            run()
            points.append((4 * values, _time(comm, run, repeats)))
        fits[name] = _fit(points)
    shared = shared_exchange(comm, range(10, 23, 3 if args.quick else 2), 4 * repeats)
    found = {"ranks": size, "fits": fits, "shared": shared, "crowding": crowding(comm, repeats)}
    found["phases"] = phases(comm, repeats)
    if comm.Get_rank() == 0:
        print(json.dumps(found), flush=True)


if __name__ == "__main__":
    main()
