"""The Communicator contract, and one process. Buffers are reduced in place: contiguous numpy
or device arrays (``__cuda_array_interface__``). After a ``Handle``'s ``wait()`` the buffer holds
the result for the host (numpy) or for work queued afterwards on the current CUDA stream."""

from __future__ import annotations

import sys
from typing import Any, Protocol

import numpy as np

OPS = ("sum", "max", "min")


class Handle(Protocol):
    """A pending non-blocking operation."""

    def wait(self) -> None:
        """Block until the buffer holds the result (idempotent)."""
        ...


class DoneHandle:
    """A handle for an operation that finished before it was returned."""

    __slots__ = ()

    def wait(self) -> None:
        """Nothing to wait for."""


DONE = DoneHandle()


def check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"reduction op {op!r}: expected one of {', '.join(OPS)}")


def is_device_array(buf: Any) -> bool:
    """True for arrays in GPU memory (CuPy, Numba CUDA...): they carry the CUDA interface."""
    return type(buf) is not np.ndarray and hasattr(buf, "__cuda_array_interface__")


class Communicator:
    """Base class: the interface, the checks, and what needs no transport.

    ``name`` says which path is live ("self", "mpi-shm", "mpi-host", "mpi-cuda", "nccl");
    ``fallback_reason`` is set when an explicit ``--comm`` request could not be honoured;
    ``detail`` says in a few words why ``auto`` chose this one; ``auto_fallback`` why ``auto``
    settled for it rather than the faster transport it tries first (said as a note).

    Capabilities are attributes, read by the update schemes: ``node_memory``, the ranks of a
    node can allocate arrays they all map (``shared_zeros``, ``fence``, ``local_rank``,
    ``local_size``, ``nodes``, ``cross_allreduce_``: ``shm.ShmCommunicator``);
    ``device_buffers``, device arrays go to the transport without a copy through the host.
    """

    name: str = "base"
    node_memory: bool = False
    device_buffers: bool = False

    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self.size = size
        self.fallback_reason: str | None = None
        self.detail: str | None = None
        self.auto_fallback: str | None = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} rank {self.rank}/{self.size}>"

    def allreduce_(self, buf: Any, op: str = "sum") -> None:
        """Reduce ``buf`` across ranks, in place."""
        raise NotImplementedError

    def iallreduce_(self, buf: Any, op: str = "sum") -> Handle:
        """Start an in-place reduction; the result is there after ``handle.wait()``."""
        raise NotImplementedError

    def bcast_(self, buf: Any, root: int = 0) -> None:
        """Overwrite ``buf`` on every rank with root's."""
        raise NotImplementedError

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        raise NotImplementedError

    def allreduce_host(self, values: Any, op: str = "sum") -> np.ndarray:
        """Reduce a small host array (metrics: sums and counts) in float64; returns a new array.

        float64 holds integers exactly up to 2**53, so counts summed across ranks are exact.
        """
        raise NotImplementedError

    def allgather_obj(self, obj: Any) -> list:
        """Gather one small picklable object from every rank, in rank order."""
        raise NotImplementedError

    def abort(self, code: int) -> None:
        """End the whole job now with ``code`` (used when one rank fails)."""
        raise NotImplementedError

    def isend(self, buf: Any, dest: int, tag: int = 0) -> Handle:
        """Start sending ``buf`` to rank ``dest`` (pipeline stages); after ``wait()`` the
        buffer may be reused. Messages between two ranks with one tag arrive in order."""
        raise NotImplementedError(f"{self.name}: no point-to-point messages")

    def recv_(self, buf: Any, source: int, tag: int = 0) -> None:
        """Fill ``buf`` with the next message from rank ``source`` (blocking)."""
        raise NotImplementedError(f"{self.name}: no point-to-point messages")

    @staticmethod
    def _host_values(values: Any) -> np.ndarray:
        return np.array(values, dtype=np.float64, copy=True).reshape(-1)


class SelfCommunicator(Communicator):
    """One process: every collective is the identity, so it costs nothing."""

    name = "self"

    def __init__(self) -> None:
        super().__init__(0, 1)

    def allreduce_(self, buf: Any, op: str = "sum") -> None:
        check_op(op)

    def iallreduce_(self, buf: Any, op: str = "sum") -> Handle:
        check_op(op)
        return DONE

    def bcast_(self, buf: Any, root: int = 0) -> None:
        if root != 0:
            raise ValueError(f"bcast root {root} out of range for 1 rank")

    def barrier(self) -> None:
        pass

    def allreduce_host(self, values: Any, op: str = "sum") -> np.ndarray:
        check_op(op)
        return self._host_values(values)

    def allgather_obj(self, obj: Any) -> list:
        return [obj]

    def abort(self, code: int) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.exit(code)
