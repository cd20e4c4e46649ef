"""Node-shared memory: a node's ranks map arrays they share; ``cross`` joins the nodes."""

import contextlib
import math
import os
from typing import Any

import numpy as np

from xpnn.errors import UserError
from xpnn.parallel.comm.mpi import MpiHostCommunicator
from xpnn.parallel.comm.narrow import sum_op
from xpnn.record.phases import FENCES
from xpnn.runtime import flight, stall
from xpnn.runtime.segments import SHM_DIR

RANKS_PER_NODE_VAR = "XPNN_RANKS_PER_NODE"  # tests: pretend one machine is several nodes
ALIGN = 16  # share bounds on 64-byte lines (float32), so ranks never write one cache line


def padded(n: int, align: int) -> int:
    return -(-n // align) * align


def share_bounds(
    start: int, end: int, parts: int, index: int, align: int = ALIGN
) -> tuple[int, int]:
    """[lo, hi) of part ``index`` of ``range(start, end)`` cut at multiples of ``align``."""
    per = -(-(end - start) // parts)
    lo, hi = (
        start if k <= 0 else min(end, padded(start + k * per, align)) for k in (index, index + 1)
    )
    return lo, hi


def shm_free_bytes(path: str = SHM_DIR) -> int | None:
    """Free bytes for shared segments: MPI maps a larger one, and the first write past kills."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def forced_ranks_per_node() -> int | None:
    forced = os.environ.get(RANKS_PER_NODE_VAR, "").strip()
    if not forced:
        return None
    with contextlib.suppress(ValueError):
        if (k := int(forced)) >= 1:
            return k
    raise UserError(f"{RANKS_PER_NODE_VAR}={forced}: expected a positive integer")


class ShmCommunicator(MpiHostCommunicator):
    """MPI plus arrays shared by the ranks of a node; built by ``create``."""

    name = "mpi-shm"
    node_memory = True

    def __init__(self, mpi_comm: Any, node: Any, cross: Any) -> None:
        super().__init__(mpi_comm)
        self.node, self.cross = node, cross
        self.local_rank, self.local_size = node.Get_rank(), node.Get_size()
        self.nodes = cross.Get_size()
        self._windows: list[Any] = []

    @classmethod
    def create(cls, mpi_comm: Any) -> "ShmCommunicator":
        """Collective; refused on every rank where nodes hold different numbers of ranks."""
        from mpi4py import MPI

        node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=mpi_comm.Get_rank())
        # tests: each k consecutive job ranks a node, by the job's rank (a 2-D group's are not)
        if (k := forced_ranks_per_node()) is not None:
            group = node.Split(color=MPI.COMM_WORLD.Get_rank() // k, key=node.Get_rank())
            node.Free()
            node = group
        sizes = mpi_comm.allgather(node.Get_size())
        if len(set(sizes)) != 1:
            node.Free()
            counts = ", ".join(map(str, sorted(set(sizes))))
            raise UserError(
                f"`comm` mpi-shm: nodes hold different numbers of ranks ({counts}); "
                "give every node the same number, or use `comm` mpi-host"
            )
        return cls(mpi_comm, node, mpi_comm.Split(color=node.Get_rank(), key=mpi_comm.Get_rank()))

    def shared_zeros(self, shape: tuple[int, ...] | int, dtype: Any) -> np.ndarray:
        """A zero array the node's ranks map (collective), locked for ``fence`` until ``free``."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        mib = f"{nbytes / 2**20:.1f} MiB"
        free = self.node.bcast(shm_free_bytes() if self.local_rank == 0 else None, root=0)
        if free is not None and nbytes > free:
            need = f"needs {mib} of shared memory but {SHM_DIR} has {free / 2**20:.1f} MiB free"
            fix = "enlarge it (docker run --shm-size) or use `comm` mpi-host"
            raise UserError(f"`comm` mpi-shm: {need}; {fix}")
        MPI = self._MPI
        mine = nbytes if self.local_rank == 0 else 0  # the node's memory is local rank 0's
        try:
            win = MPI.Win.Allocate_shared(mine, dtype.itemsize, comm=self.node)
        except MPI.Exception as exc:  # e.g. a container's small /dev/shm
            why = f"could not allocate {mib} of shared memory ({exc.Get_error_string()})"
            raise UserError(f"`comm` mpi-shm: {why}; use `comm` mpi-host") from None
        win.Lock_all(MPI.MODE_NOCHECK)
        self._windows.append(win)
        buf, _ = win.Shared_query(0)
        array = np.ndarray(shape, dtype=dtype, buffer=buf)
        if self.local_rank == 0:
            array[...] = 0
        self.fence()
        return array

    def fence(self) -> None:
        """Node barrier with memory ordering (MPI's Sync / Barrier / Sync idiom)."""
        with FENCES:
            for win in self._windows:
                win.Sync()
            with flight.Op(self, "node barrier"):
                stall.wait(self.node.Ibarrier(), "a node barrier")
            for win in self._windows:
                win.Sync()

    def cross_bcast_(self, buf: np.ndarray) -> None:
        """World rank 0's ``buf`` to the same-place rank of every node (node-local rank 0s)."""
        if self.nodes > 1:
            stall.wait(self.cross.Ibcast(buf, root=0), "a broadcast across nodes")

    def cross_allreduce_(self, buf: np.ndarray, mop: Any = None) -> None:
        if self.nodes > 1:
            self._count(buf)
            with flight.Op(self, "allreduce across nodes", buf.nbytes):
                req = self.cross.Iallreduce(self._in_place, buf, mop or self._MPI.SUM)
                stall.wait(req, "an allreduce")

    def cross_allreduce_sum16_(self, bits: np.ndarray, dtype: str) -> None:
        if self.nodes > 1:
            self.cross_allreduce_(bits, sum_op(dtype))

    def free(self) -> None:
        for win in self._windows:
            win.Unlock_all()
            win.Free()
        self._windows.clear()
