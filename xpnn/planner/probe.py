"""Under ``mpiexec -n R``: collectives' alpha and beta, crowding, phases; rank 0 prints JSON."""

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


def _op(comm, name: str, values: int):  # noqa: ANN001, ANN202
    size, peer = comm.Get_size(), comm.Get_rank() ^ 1
    send = np.ones(values, dtype=np.float32)
    recv = np.empty(values, dtype=np.float32)
    part = np.empty(values // size, dtype=np.float32)  # a rank's share, scattered or gathered
    mine, whole = send[: part.size], np.empty(part.size * size, dtype=np.float32)
    if name == "sendrecv" and peer >= size:  # an odd rank count: the last rank has no partner
        return lambda: None
    return {
        "allreduce": lambda: comm.Allreduce(send, recv),
        "reduce_scatter": lambda: comm.Reduce_scatter_block(send[: part.size * size], part),
        "allgather": lambda: comm.Allgather(mine, whole),
        "bcast": lambda: comm.Bcast(send, root=0),
        "sendrecv": lambda: comm.Sendrecv(send, peer, recvbuf=recv, source=peer),
    }[name]


def _fit_sizes(comm, exponents: range, repeats: int, make) -> list[float]:  # noqa: ANN001
    """[alpha, beta] of ``make(values)``'s (run, bytes): the slowest rank's medians, fitted."""
    nbytes, seconds = [], []
    for e in exponents:
        run, moved = make(max(comm.Get_size(), (1 << e) // 4))
        run()
        samples = []
        for _ in range(repeats):
            comm.Barrier()
            samples.append(_clock(run))
        nbytes.append(moved)
        seconds.append(comm.allreduce(statistics.median(samples), op=MPI.MAX))
    beta, alpha = np.polyfit(nbytes, seconds, 1, w=1.0 / np.array(seconds, dtype=np.float64))
    return [max(float(alpha), 0.0), max(float(beta), 0.0)]


def shared_exchange(comm, exponents: range, repeats: int) -> list[float]:  # noqa: ANN001
    """[alpha, beta] of a node-shared exchange: write a share, the run's fence, read the others'."""
    shm = ShmCommunicator.create(comm)

    def exchange(values: int):  # noqa: ANN202
        shm.free()  # one shared array at a time
        shared = shm.shared_zeros(values, np.float32)
        lo, hi = (r * values // shm.local_size for r in (shm.local_rank, shm.local_rank + 1))
        mine = np.ones(hi - lo, dtype=np.float32)

        def run() -> None:
            shared[lo:hi] = mine
            shm.fence()
            shared[:lo].sum()
            shared[hi:].sum()

        return run, 4.0 * (values - (hi - lo))  # the values the other ranks wrote

    fit = _fit_sizes(comm, exponents, repeats, exchange)
    shm.free()
    return fit


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
    exponents = range(10, 25, 3) if args.quick else range(8, 26, 2)  # 256 B .. 32 MiB
    repeats = 3 if args.quick else 7
    fits = {
        name: _fit_sizes(comm, exponents, repeats, lambda v, n=name: (_op(comm, n, v), 4 * v))
        for name in OPS
    }
    shared = shared_exchange(comm, range(10, 23, 3 if args.quick else 2), 4 * repeats)
    found = {"ranks": comm.Get_size(), "fits": fits, "shared": shared}
    found |= {"crowding": crowding(comm, repeats), "phases": phases(comm, repeats)}
    if comm.Get_rank() == 0:
        print(json.dumps(found), flush=True)


if __name__ == "__main__":
    main()
