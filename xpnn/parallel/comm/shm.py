"""Node-shared memory: ranks on one node share buffers instead of sending them to each other.

On one node, an allreduce of the gradients is memory traffic dressed up as messages: MPI copies
every byte into a shared segment and out again, and then every rank runs the same optimizer
update on the same numbers. ``ShmCommunicator`` lets ranks allocate arrays in memory that every
rank of the node maps (``MPI.Win.Allocate_shared``), so the parameters exist once per node and
each rank reads the others' gradients where they lie (``parallel.update.node_shared``).
``share_bounds`` cuts a range into the ranks' shares on cache lines.

Ranks are grouped by node (``Split_type(COMM_TYPE_SHARED)``); ``cross`` joins the ranks that
have the same node-local rank on every node, for the one message that must leave the node.
Everything else (metrics, barriers, ``allreduce_``) is inherited from ``MpiHostCommunicator``.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from xpnn.errors import UserError
from xpnn.parallel.comm.mpi import MpiHostCommunicator
from xpnn.phases import FENCES
from xpnn.runtime import stall
from xpnn.runtime.segments import SHM_DIR

RANKS_PER_NODE_VAR = "XPNN_RANKS_PER_NODE"  # tests: pretend one machine is several nodes
ALIGN = 16  # share bounds on 64-byte lines (float32), so ranks never write one cache line


def padded(n: int, align: int) -> int:
    """``n`` rounded up to a multiple of ``align``."""
    return -(-n // align) * align


def share_bounds(
    start: int, end: int, parts: int, index: int, align: int = ALIGN
) -> tuple[int, int]:
    """[lo, hi) of part ``index`` when ``range(start, end)`` is cut into ``parts`` near-equal
    slices at multiples of ``align`` (the last may be shorter; some may be empty if tiny)."""
    per = -(-(end - start) // parts)

    def cut(k: int) -> int:
        if k <= 0:
            return start
        return min(end, padded(start + k * per, align))

    return cut(index), cut(index + 1)


def shm_free_bytes(path: str = SHM_DIR) -> int | None:
    """Free bytes where shared segments live (None where that cannot be known).

    Checked before allocating because a segment larger than the space left (Docker's default
    /dev/shm is 64 MiB) is not refused by MPI: it is mapped, and the first write past the end
    of the space kills the process with SIGBUS, or a huge one keeps it writing for minutes.
    """
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def forced_ranks_per_node() -> int | None:
    """``XPNN_RANKS_PER_NODE``, or None where it is not set."""
    forced = os.environ.get(RANKS_PER_NODE_VAR, "").strip()
    if not forced:
        return None
    try:
        k = int(forced)
        if k < 1:
            raise ValueError
    except ValueError:
        raise UserError(f"{RANKS_PER_NODE_VAR}={forced}: expected a positive integer") from None
    return k


def _node_comm(world_comm: Any, MPI: Any) -> Any:
    """The ranks of ``world_comm`` that share this node's memory, in its order
    (``XPNN_RANKS_PER_NODE=k`` pretends the job's ranks 0..k-1, k..2k-1, ... are nodes, so a
    multi-node layout can be tested on one machine)."""
    node = world_comm.Split_type(MPI.COMM_TYPE_SHARED, key=world_comm.Get_rank())
    k = forced_ranks_per_node()
    if k is None:
        return node
    # by the rank in the whole job: ``world_comm`` may be a data-parallel group (2-D layouts),
    # whose ranks are not consecutive in the job
    group = node.Split(color=MPI.COMM_WORLD.Get_rank() // k, key=node.Get_rank())
    node.Free()
    return group


class ShmCommunicator(MpiHostCommunicator):
    """MPI plus arrays shared by the ranks of a node. Build with ``ShmCommunicator.create``."""

    name = "mpi-shm"
    node_memory = True

    def __init__(self, mpi_comm: Any, node: Any, cross: Any) -> None:
        super().__init__(mpi_comm)
        self.node, self.cross = node, cross
        self.local_rank, self.local_size = node.Get_rank(), node.Get_size()
        self.nodes = cross.Get_size()
        self._windows: list[Any] = []

    @classmethod
    def create(cls, mpi_comm: Any) -> ShmCommunicator:
        """Collective over ``mpi_comm``. Raises UserError (on every rank alike) when the nodes
        hold different numbers of ranks: the shards of a node must line up across nodes."""
        from mpi4py import MPI

        node = _node_comm(mpi_comm, MPI)
        sizes = mpi_comm.allgather(node.Get_size())
        if len(set(sizes)) != 1:
            node.Free()
            counts = ", ".join(str(s) for s in sorted(set(sizes)))
            raise UserError(
                f"`comm` mpi-shm: nodes hold different numbers of ranks ({counts}); "
                "give every node the same number, or use `comm` mpi-host"
            )
        cross = mpi_comm.Split(color=node.Get_rank(), key=mpi_comm.Get_rank())
        comm = cls(mpi_comm, node, cross)
        comm.detail = (
            f"shared memory, {comm.local_size} rank(s) per node x {comm.nodes} node(s)"
            if comm.nodes > 1
            else f"shared memory, {comm.local_size} rank(s) on one node"
        )
        return comm

    def shared_zeros(self, shape: tuple[int, ...] | int, dtype: Any) -> np.ndarray:
        """A zero-filled array that every rank of the node maps; collective over the node.

        Node-local rank 0 allocates the segment and the others map it. The window stays open
        (in a passive-target epoch, so ``fence`` can order memory) until ``free``.
        """
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        free = self.node.bcast(shm_free_bytes() if self.local_rank == 0 else None, root=0)
        if free is not None and nbytes > free:
            raise UserError(
                f"`comm` mpi-shm: needs {nbytes / 2**20:.1f} MiB of shared memory but "
                f"{SHM_DIR} has {free / 2**20:.1f} MiB free; enlarge it (docker run "
                "--shm-size) or use `comm` mpi-host"
            )
        MPI = self._MPI
        try:
            win = MPI.Win.Allocate_shared(
                nbytes if self.local_rank == 0 else 0, dtype.itemsize, comm=self.node
            )
        except MPI.Exception as exc:  # e.g. a container's small /dev/shm
            raise UserError(
                f"`comm` mpi-shm: could not allocate {nbytes / 2**20:.1f} MiB of shared memory "
                f"({exc.Get_error_string()}); use `comm` mpi-host"
            ) from None
        win.Lock_all(MPI.MODE_NOCHECK)
        self._windows.append(win)
        buf, _ = win.Shared_query(0)
        array = np.ndarray(shape, dtype=dtype, buffer=buf)
        if self.local_rank == 0:
            array[...] = 0
        self.fence()
        return array

    def fence(self) -> None:
        """Node barrier with memory ordering: what a rank wrote to shared arrays before it is
        seen by every rank of the node after it (MPI's Sync / Barrier / Sync idiom)."""
        with FENCES:
            for win in self._windows:
                win.Sync()
            stall.wait(self.node.Ibarrier(), "a node barrier")
            for win in self._windows:
                win.Sync()

    def cross_allreduce_(self, buf: np.ndarray) -> None:
        """Sum ``buf`` in place over the ranks with this node-local rank on every node."""
        if self.nodes > 1:
            stall.wait(self.cross.Iallreduce(self._in_place, buf, self._MPI.SUM), "an allreduce")

    def free(self) -> None:
        """Release the shared segments (their arrays must not be used afterwards)."""
        for win in self._windows:
            win.Unlock_all()
            win.Free()
        self._windows.clear()
