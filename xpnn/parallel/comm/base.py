"""The Communicator contract, and one process. Buffers are reduced in place: contiguous numpy
or device arrays (``__cuda_array_interface__``). After a ``Handle``'s ``wait()`` the buffer holds
the result for the host (numpy) or for work queued afterwards on the current CUDA stream."""

from __future__ import annotations

import sys
from typing import Any, Protocol

import numpy as np

from xpnn.parallel.comm.narrow import check_narrow

OPS = ("sum", "max", "min")


class Handle(Protocol):
    def wait(self) -> None:
        """Block until the buffer holds the result (idempotent)."""
        ...


class DoneHandle:
    """An operation that finished before it was returned."""

    __slots__ = ()

    def wait(self) -> None:
        pass


DONE = DoneHandle()


def check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"reduction op {op!r}: expected one of {', '.join(OPS)}")


def check_counts(buf: Any, counts: list[int], ranks: int) -> list[int]:
    """The start of each rank's piece of flat ``buf``; the pieces cover it, one a rank."""
    size = int(buf.shape[0])  # a flat buffer
    if len(counts) != ranks or min(counts) < 0 or sum(counts) != size:
        raise ValueError(f"piece sizes {counts} do not cut {size} values over {ranks} ranks")
    return [sum(counts[:r]) for r in range(ranks)]


class Communicator:
    """The interface. ``fallback_reason``: why an explicit ``--comm`` was not honoured;
    ``detail``: why this one; ``auto_fallback``: why ``auto`` settled for it. Capabilities:
    ``node_memory`` (``shm.ShmCommunicator``'s interface), ``device_buffers`` (no host copy).

    ``bytes_sent``: the payload bytes this rank has handed to the transport, what it
    contributes and not the library's wire traffic (a ring allreduce moves about twice that):
    ``allreduce_``, ``iallreduce_``, ``iallreduce_sum16_`` (2 bytes a value), ``allreduce_host``
    and ``isend`` count their buffer; a ``bcast_`` counts on its root only and ``recv_`` not at
    all (the sender counted it). ``ireduce_scatter_`` counts the pieces other ranks receive
    (this rank's own piece stays here) and ``iallgather_`` this rank's piece: together one
    buffer's bytes, as an allreduce of it.
    Barriers, ``allgather_obj`` (small setup objects) and node-shared memory count nothing.
    An integer add per call, never a sync: read it before and after what is to be measured."""

    name: str = "base"
    node_memory: bool = False
    device_buffers: bool = False

    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self.size = size
        self.fallback_reason: str | None = None
        self.detail: str | None = None
        self.auto_fallback: str | None = None
        self.bytes_sent = 0

    def _count(self, buf: Any) -> None:
        """``buf`` handed to the transport by this rank: the one place bytes are counted."""
        self.bytes_sent += buf.nbytes

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} rank {self.rank}/{self.size}>"

    def allreduce_(self, buf: Any, op: str = "sum") -> None:
        raise NotImplementedError

    def iallreduce_(self, buf: Any, op: str = "sum") -> Handle:
        raise NotImplementedError

    def iallreduce_sum16_(self, bits: Any, dtype: str) -> Handle:
        """Sum, in place, 16-bit floats ``dtype`` (``narrow.NARROW``) held as ``uint16`` bits:
        MPI has no such type, so each pair is added in float32 and rounded once."""
        raise NotImplementedError

    def bcast_(self, buf: Any, root: int = 0) -> None:
        raise NotImplementedError

    def ireduce_scatter_(self, buf: Any, counts: list[int]) -> Handle:
        """Sum ``buf`` over the ranks, each rank receiving its piece alone: ``counts`` cut
        ``buf`` into consecutive pieces, rank order; after ``wait()`` this rank's piece holds
        the sum and the rest of ``buf`` is undefined (ZeRO's gradients, half an allreduce)."""
        raise NotImplementedError

    def iallgather_(self, buf: Any, counts: list[int]) -> Handle:
        """Every rank's piece of ``buf`` (cut by ``counts`` as ``ireduce_scatter_``'s) copied
        from it to every rank, in place, once ``wait()`` returns: the allreduce's other half."""
        raise NotImplementedError

    def allgather_(self, buf: Any, counts: list[int]) -> None:
        """``iallgather_``, waited for."""
        self.iallgather_(buf, counts).wait()

    def barrier(self) -> None:
        raise NotImplementedError

    def allreduce_host(self, values: Any, op: str = "sum") -> np.ndarray:
        """Reduce a small host array in float64 (counts exact to 2**53); a new array."""
        raise NotImplementedError

    def allgather_obj(self, obj: Any, what: str = "a gathering of objects") -> list:
        """One small picklable object from every rank, in rank order; ``what`` names the wait
        for the stall watch (it polls, so a rank that never comes is said, not hung on)."""
        raise NotImplementedError

    def bcast_obj(self, obj: Any, root: int = 0, what: str = "a broadcast of an object") -> Any:
        """``root``'s small picklable object, on every rank (polled as ``allgather_obj``)."""
        raise NotImplementedError

    def abort(self, code: int) -> None:
        raise NotImplementedError

    def isend(self, buf: Any, dest: int, tag: int = 0) -> Handle:
        """After ``wait()`` the buffer may be reused; messages with one tag arrive in order."""
        raise NotImplementedError(f"{self.name}: no point-to-point messages")

    def recv_(self, buf: Any, source: int, tag: int = 0) -> None:
        raise NotImplementedError(f"{self.name}: no point-to-point messages")

    @staticmethod
    def _host_values(values: Any) -> np.ndarray:
        return np.array(values, dtype=np.float64, copy=True).reshape(-1)


class SelfCommunicator(Communicator):
    """One process: every collective is the identity, so nothing is sent (``bytes_sent`` 0)."""

    name = "self"

    def __init__(self) -> None:
        super().__init__(0, 1)

    def allreduce_(self, buf: Any, op: str = "sum") -> None:
        check_op(op)

    def iallreduce_(self, buf: Any, op: str = "sum") -> Handle:
        check_op(op)
        return DONE

    def iallreduce_sum16_(self, bits: Any, dtype: str) -> Handle:
        check_narrow(dtype)
        return DONE

    def bcast_(self, buf: Any, root: int = 0) -> None:
        if root != 0:
            raise ValueError(f"bcast root {root} out of range for 1 rank")

    def ireduce_scatter_(self, buf: Any, counts: list[int]) -> Handle:
        check_counts(buf, counts, 1)
        return DONE

    def iallgather_(self, buf: Any, counts: list[int]) -> Handle:
        check_counts(buf, counts, 1)
        return DONE

    def barrier(self) -> None:
        pass

    def allreduce_host(self, values: Any, op: str = "sum") -> np.ndarray:
        check_op(op)
        return self._host_values(values)

    def allgather_obj(self, obj: Any, what: str = "") -> list:
        return [obj]

    def bcast_obj(self, obj: Any, root: int = 0, what: str = "") -> Any:
        if root != 0:
            raise ValueError(f"bcast root {root} out of range for 1 rank")
        return obj

    def abort(self, code: int) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.exit(code)
