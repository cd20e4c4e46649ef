"""MPI on host memory (``mpi-host``); device buffers staged through reused pinned buffers."""

import functools
import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from xpnn.parallel.comm.arrays import CUPY, Arrays
from xpnn.parallel.comm.base import DONE, Communicator, Handle, check_counts, check_op
from xpnn.parallel.comm.narrow import sum_op
from xpnn.record import phases
from xpnn.runtime import flight, stall


class MpiHandle:
    """An MPI request, its buffer (alive until done) and what it is, for stall warnings."""

    __slots__ = ("_req", "_buf", "_what")

    def __init__(self, req: Any, buf: Any, what: str = "a transfer") -> None:
        self._req, self._buf, self._what = req, buf, what

    def wait(self) -> None:
        if self._req is not None:
            stall.wait(self._req, self._what)
            self._req = self._buf = None


@dataclass(slots=True)
class _PinnedSlot:
    """A pinned host buffer and the event that ends its last host-to-device copy."""

    host: np.ndarray
    event: Any = None


class _PinnedPool:
    """Pinned host buffers per (size, dtype), reused once their copy back to the device is done."""

    def __init__(self, arrays: Arrays) -> None:
        self._arrays = arrays
        self._free: dict[tuple[int, np.dtype], list[_PinnedSlot]] = {}
        self.allocated = 0

    def slot_for(self, dev: Any) -> _PinnedSlot:
        size, dtype = dev.shape[0], self._arrays.host_dtype(dev)  # ``dev``: flat
        free = self._free.get((size, dtype))
        if not free:
            self.allocated += 1
            return _PinnedSlot(self._arrays.empty_pinned(size, dtype))
        slot = free.pop()
        if slot.event is not None:
            slot.event.synchronize()
            slot.event = None
        return slot

    def release(self, slot: _PinnedSlot) -> None:
        self._free.setdefault((slot.host.size, slot.host.dtype), []).append(slot)

    def copy_out(self, dev: Any) -> _PinnedSlot:
        slot = self.slot_for(dev)
        with phases.span("device to host", phases.COPIES):
            self._arrays.copy_out(dev, slot.host)
        return slot

    def copy_back(self, dev: Any, slot: _PinnedSlot) -> None:
        with phases.span("host to device (queued)", phases.COPIES):
            slot.event = self._arrays.copy_back(dev, slot.host)
        self.release(slot)


class _StagedHandle(MpiHandle):
    """A request on a pinned copy of ``dev``, copied back at ``wait`` (``dev`` None: a send)."""

    __slots__ = ("_dev", "_slot", "_pool")

    def __init__(self, req: Any, dev: Any, slot: _PinnedSlot, pool: _PinnedPool, what: str) -> None:
        super().__init__(req, None, what)
        self._dev, self._slot, self._pool = dev, slot, pool

    def wait(self) -> None:
        if self._req is None:
            return
        super().wait()
        if self._dev is None:
            self._pool.release(self._slot)
        else:
            self._pool.copy_back(self._dev, self._slot)
        self._dev = self._slot = None


class MpiHostCommunicator(Communicator):
    """MPI on host memory; ``arrays``: the library whose device buffers come (staged)."""

    name = "mpi-host"

    def __init__(self, mpi_comm: Any, arrays: Arrays = CUPY) -> None:
        from mpi4py import MPI

        super().__init__(mpi_comm.Get_rank(), mpi_comm.Get_size())
        self._MPI, self.mpi_comm, self._in_place = MPI, mpi_comm, MPI.IN_PLACE
        self._ops = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
        self._arrays, self._pool = arrays, _PinnedPool(arrays)

    def allreduce_(self, buf: Any, op: str = "sum") -> None:
        # the hot path for every gradient bucket: kept to a dict lookup and a type check
        mop = self._ops.get(op) or check_op(op)  # an op it lacks: refused
        self._count(buf)
        with flight.Op(self, "allreduce", buf.nbytes):
            if type(buf) is np.ndarray or not self._arrays.is_device(buf):
                stall.wait(self.mpi_comm.Iallreduce(self._in_place, buf, mop), "an allreduce")
            else:
                self._device_allreduce(buf, op, mop)

    def iallreduce_(self, buf: Any, op: str = "sum") -> Handle:
        mop = self._ops.get(op) or check_op(op)
        return self._iallreduce(buf, op, mop, self._device_iallreduce)

    def iallreduce_sum16_(self, bits: Any, dtype: str) -> Handle:
        # the sum is Python code on the host: device bits are staged there even if MPI is CUDA-aware
        staged = functools.partial(MpiHostCommunicator._device_iallreduce, self)
        return self._iallreduce(bits, "sum", sum_op(dtype), staged)

    def _iallreduce(self, buf: Any, op: str, mop: Any, device: Any) -> Handle:
        self._count(buf)
        record = flight.post(self, "allreduce", buf.nbytes)
        if type(buf) is np.ndarray or not self._arrays.is_device(buf):
            req = self.mpi_comm.Iallreduce(self._in_place, buf, mop)
            return flight.Tracked(MpiHandle(req, buf, "an allreduce"), record)
        return flight.Tracked(device(buf, op, mop), record)

    def bcast_(self, buf: Any, root: int = 0) -> None:
        if self.rank == root:
            self._count(buf)
        with flight.Op(self, "broadcast", buf.nbytes):
            if self._arrays.is_device(buf):
                self._device_bcast(buf, root)
            else:
                stall.wait(self.mpi_comm.Ibcast(buf, root=root), "a broadcast")

    def ireduce_scatter_(self, buf: Any, counts: list[int]) -> Handle:
        return self._by_pieces(buf, counts, "reduce-scatter", self._reduce_pieces, False)

    def iallgather_(self, buf: Any, counts: list[int]) -> Handle:
        return self._by_pieces(buf, counts, "all-gather", self._gather_pieces, True)

    def _by_pieces(self, buf: Any, counts: list[int], op: str, post: Any, own: bool) -> Handle:
        """``op`` over ``buf`` cut by ``counts``; counted as sent: the ``own`` piece or the rest."""
        starts = check_counts(buf, counts, self.size)
        mine = counts[self.rank] * (buf.nbytes // buf.shape[0] if buf.shape[0] else 0)
        sent = mine if own else buf.nbytes - mine
        self.bytes_sent += sent
        record = flight.post(self, op, sent)
        what = ("an " if op[0] in "aeiou" else "a ") + op
        if type(buf) is np.ndarray or not self._arrays.is_device(buf):
            return flight.Tracked(MpiHandle(post(buf, starts, counts), buf, what), record)
        dev = self._arrays.flat(buf)
        if not dev.shape[0]:
            return flight.Tracked(DONE, record)
        slot = self._pool.copy_out(dev)
        staged = _StagedHandle(post(slot.host, starts, counts), dev, slot, self._pool, what)
        return flight.Tracked(staged, record)

    def _reduce_pieces(self, host: np.ndarray, starts: list[int], counts: list[int]) -> Any:
        """A reduce of each piece to its rank (``Ireduce_scatter`` would move this rank's)."""
        reqs = []
        for root, (start, count) in enumerate(zip(starts, counts, strict=True)):
            if count:
                piece = host[start : start + count]
                send, recv = (self._in_place, piece) if root == self.rank else (piece, None)
                reqs.append(self.mpi_comm.Ireduce(send, recv, self._ops["sum"], root=root))
        # waited as one request (``stall.wait`` asks ``Test``); a finished one tests true again
        return SimpleNamespace(Test=lambda: all(req.Test() for req in reqs))

    def _gather_pieces(self, host: np.ndarray, starts: list[int], counts: list[int]) -> Any:
        return self.mpi_comm.Iallgatherv(self._in_place, [host, (counts, starts)])

    def barrier(self) -> None:
        with flight.Op(self, "barrier"):
            stall.wait(self.mpi_comm.Ibarrier(), "a barrier")

    def _device_allreduce(self, buf: Any, op: str, mop: Any) -> None:
        self._device_iallreduce(buf, op, mop).wait()

    def _device_iallreduce(self, buf: Any, op: str, mop: Any) -> Handle:
        dev = self._arrays.flat(buf)
        if not dev.shape[0]:
            return DONE
        slot = self._pool.copy_out(dev)
        req = self.mpi_comm.Iallreduce(self._in_place, slot.host, mop)
        return _StagedHandle(req, dev, slot, self._pool, "an allreduce")

    def _device_bcast(self, buf: Any, root: int) -> None:
        dev = self._arrays.flat(buf)
        if not dev.shape[0]:
            return
        slot = self._pool.copy_out(dev) if self.rank == root else self._pool.slot_for(dev)
        stall.wait(self.mpi_comm.Ibcast(slot.host, root=root), "a broadcast")
        if self.rank == root:
            self._pool.release(slot)
        else:
            self._pool.copy_back(dev, slot)

    def isend(self, buf: Any, dest: int, tag: int = 0) -> Handle:
        self._count(buf)
        record = flight.post(self, "send", buf.nbytes, dest)
        if self._arrays.is_device(buf):
            return flight.Tracked(self._device_isend(buf, dest, tag), record)
        req = self.mpi_comm.Isend(buf, dest=dest, tag=tag)
        return flight.Tracked(MpiHandle(req, buf, f"a send to rank {dest}"), record)

    def recv_(self, buf: Any, source: int, tag: int = 0) -> None:
        with flight.Op(self, "receive", buf.nbytes, source):
            if self._arrays.is_device(buf):
                self._device_recv(buf, source, tag)
            else:
                what = f"a receive from rank {source}"
                stall.wait(self.mpi_comm.Irecv(buf, source=source, tag=tag), what)

    def _device_isend(self, buf: Any, dest: int, tag: int) -> Handle:
        slot = self._pool.copy_out(self._arrays.flat(buf))
        req = self.mpi_comm.Isend(slot.host, dest=dest, tag=tag)
        return _StagedHandle(req, None, slot, self._pool, "a send")

    def _device_recv(self, buf: Any, source: int, tag: int) -> None:
        dev = self._arrays.flat(buf)
        slot = self._pool.slot_for(dev)
        what = f"a receive from rank {source}"
        stall.wait(self.mpi_comm.Irecv(slot.host, source=source, tag=tag), what)
        self._pool.copy_back(dev, slot)

    def allgather_obj(self, obj: Any, what: str = "a barrier before gathering") -> list:
        return stall.allgather(self.mpi_comm, obj, what)

    def bcast_obj(self, obj: Any, root: int = 0, what: str = "a barrier before a broadcast") -> Any:
        stall.wait(self.mpi_comm.Ibarrier(), what)  # MPI has no non-blocking bcast of objects
        return self.mpi_comm.bcast(obj, root=root)

    def abort(self, code: int) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self._MPI.COMM_WORLD.Abort(code)
