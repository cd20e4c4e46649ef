"""The Communicator contract, and one process; buffers are reduced in place, done at ``wait()``."""

import sys
from types import SimpleNamespace
from typing import Any, Protocol

import numpy as np

from xpnn.parallel.comm.narrow import check_narrow

OPS = ("sum", "max", "min")


class Handle(Protocol):
    def wait(self) -> None: ...  # until the buffer holds the result (idempotent)


DONE: Handle = SimpleNamespace(wait=lambda: None)  # an operation done before it was returned


def check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"reduction op {op!r}: expected one of {', '.join(OPS)}")


def check_counts(buf: Any, counts: list[int], ranks: int) -> list[int]:
    """The start of each rank's piece of flat ``buf``; the pieces cover it, one a rank."""
    size = int(buf.shape[0])
    if len(counts) != ranks or min(counts) < 0 or sum(counts) != size:
        raise ValueError(f"piece sizes {counts} do not cut {size} values over {ranks} ranks")
    return [sum(counts[:r]) for r in range(ranks)]


class Communicator:
    """The interface, and one process: every collective the identity (``SelfCommunicator``)."""

    name: str = "base"
    node_memory: bool = False  # ``shm.ShmCommunicator``'s interface
    device_buffers: bool = False  # device buffers go without a host copy

    def __init__(self, rank: int = 0, size: int = 1) -> None:
        self.rank, self.size = rank, size
        self.fallback_reason: str | None = None  # why an explicit ``--comm`` was not honoured
        self.detail: str | None = None  # why this transport
        self.auto_fallback: str | None = None  # why ``auto`` settled for it
        self.bytes_sent = 0  # the payload handed to the transport (node memory's: none)

    def _count(self, buf: Any) -> None:
        self.bytes_sent += buf.nbytes

    def allreduce_(self, buf: Any, op: str = "sum") -> None:
        check_op(op)

    def iallreduce_(self, buf: Any, op: str = "sum") -> Handle:
        check_op(op)
        return DONE

    def iallreduce_sum16_(self, bits: Any, dtype: str) -> Handle:
        """Sum 16-bit floats ``dtype`` (``narrow.NARROW``) held as ``uint16`` bits."""
        check_narrow(dtype)
        return DONE

    def bcast_(self, buf: Any, root: int = 0) -> None:
        self.bcast_obj(None, root)

    def ireduce_scatter_(self, buf: Any, counts: list[int]) -> Handle:
        """Sum ``buf``, cut by ``counts`` one piece a rank: only this rank's piece is defined."""
        check_counts(buf, counts, self.size)
        return DONE

    def iallgather_(self, buf: Any, counts: list[int]) -> Handle:
        """Every rank's piece of ``buf`` (cut as ``ireduce_scatter_``'s) to every rank."""
        check_counts(buf, counts, self.size)
        return DONE

    def allgather_(self, buf: Any, counts: list[int]) -> None:
        self.iallgather_(buf, counts).wait()

    def barrier(self) -> None:
        pass

    def allreduce_host(self, values: Any, op: str = "sum") -> np.ndarray:
        """Reduce a small host array in float64 (counts exact to 2**53); a new array."""
        out = np.array(values, dtype=np.float64, copy=True).reshape(-1)
        self.allreduce_(out, op)
        return out

    def allgather_obj(self, obj: Any, what: str = "a gathering of objects") -> list:
        """One small object from every rank, in rank order; ``what`` names the wait if it stalls."""
        return [obj]

    def bcast_obj(self, obj: Any, root: int = 0, what: str = "a broadcast of an object") -> Any:
        if root != 0:
            raise ValueError(f"bcast root {root} out of range for 1 rank")
        return obj

    def abort(self, code: int) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.exit(code)

    def isend(self, buf: Any, dest: int, tag: int = 0) -> Handle:
        """After ``wait()`` the buffer may be reused; messages with one tag arrive in order."""
        raise NotImplementedError(f"{self.name}: no point-to-point messages")

    def recv_(self, buf: Any, source: int, tag: int = 0) -> None:
        raise NotImplementedError(f"{self.name}: no point-to-point messages")


class SelfCommunicator(Communicator):
    """One process: every collective is the identity, so nothing is sent."""

    name = "self"
