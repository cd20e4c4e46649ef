"""MPI on host memory (``mpi-host``): every MPI library, CUDA-aware or not; device buffers are
staged through pinned host buffers, allocated once per bucket shape and reused."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from xpnn import phases
from xpnn.parallel.comm.base import DONE, Communicator, Handle, check_op, is_device_array
from xpnn.runtime import flight, stall


class MpiHandle:
    """An MPI request, its buffer (kept alive until done) and what it is, for stall warnings."""

    __slots__ = ("_req", "_buf", "_what")

    def __init__(self, req: Any, buf: Any, what: str = "a transfer") -> None:
        self._req = req
        self._buf = buf
        self._what = what

    def wait(self) -> None:
        if self._req is not None:
            stall.wait(self._req, self._what)
            self._req = None
            self._buf = None


class _PinnedSlot:
    """A pinned host buffer and the event that ends its last host-to-device copy."""

    __slots__ = ("host", "event")

    def __init__(self, host: np.ndarray) -> None:
        self.host = host
        self.event: Any = None


class _PinnedPool:
    """Pinned host buffers per (size, dtype), reused across steps once their copy back to
    the device is done; one per reduction of that shape in flight."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, np.dtype], list[_PinnedSlot]] = {}
        self.allocated = 0

    def acquire(self, size: int, dtype: np.dtype) -> _PinnedSlot:
        free = self._free.get((size, dtype))
        if free:
            slot = free.pop()
            if slot.event is not None:
                slot.event.synchronize()
                slot.event = None
            return slot
        self.allocated += 1
        return _PinnedSlot(_empty_pinned(size, dtype))

    def release(self, slot: _PinnedSlot) -> None:
        key = (slot.host.size, slot.host.dtype)
        self._free.setdefault(key, []).append(slot)


def _empty_pinned(size: int, dtype: np.dtype) -> np.ndarray:
    """A page-locked NumPy array: device copies run at full PCIe speed."""
    try:
        import cupyx

        return cupyx.empty_pinned((size,), dtype=dtype)
    except (ImportError, AttributeError):
        import cupy

        mem = cupy.cuda.alloc_pinned_memory(max(1, size * dtype.itemsize))
        return np.frombuffer(mem, dtype=dtype, count=size)


def as_cupy(buf: Any) -> Any:
    """A flat zero-copy CuPy view of a contiguous device array."""
    import cupy

    dev = buf if isinstance(buf, cupy.ndarray) else cupy.asarray(buf)
    if not dev.flags.c_contiguous:
        raise ValueError("communication buffers must be contiguous")
    return dev if dev.ndim == 1 else dev.reshape(-1)


class _StagedHandle:
    """A reduction staged through pinned memory, copied back to ``dev``; or a send (``dev``
    None: the host buffer only returns to the pool)."""

    __slots__ = ("_req", "_dev", "_slot", "_pool")

    def __init__(self, req: Any, dev: Any, slot: _PinnedSlot, pool: _PinnedPool) -> None:
        self._req, self._dev, self._slot, self._pool = req, dev, slot, pool

    def wait(self) -> None:
        if self._req is None:
            return
        stall.wait(self._req, "a send" if self._dev is None else "an allreduce")
        if self._dev is None:
            self._pool.release(self._slot)
        else:
            _copy_back(self._dev, self._slot, self._pool)
        self._req = self._dev = self._slot = None


def _copy_out(dev: Any, slot: _PinnedSlot) -> None:
    """Device to pinned host, after the work queued on the current stream."""
    import cupy

    with phases.span("device to host", phases.COPIES):
        dev.get(stream=cupy.cuda.get_current_stream(), out=slot.host, blocking=True)


def _copy_back(dev: Any, slot: _PinnedSlot, pool: _PinnedPool) -> None:
    """Queue the host-to-device copy on the current stream and return the buffer to the pool."""
    import cupy

    stream = cupy.cuda.get_current_stream()
    with phases.span("host to device (queued)", phases.COPIES):
        dev.set(slot.host, stream=stream)  # asynchronous from pinned memory; ordered on the stream
    slot.event = stream.record()
    pool.release(slot)


class MpiHostCommunicator(Communicator):
    """MPI on host memory; device buffers are reduced in pooled pinned host buffers."""

    name = "mpi-host"

    def __init__(self, mpi_comm: Any) -> None:
        from mpi4py import MPI

        super().__init__(mpi_comm.Get_rank(), mpi_comm.Get_size())
        self._MPI = MPI
        self._comm = mpi_comm
        self._in_place = MPI.IN_PLACE
        self._ops = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
        self._pool = _PinnedPool()

    @property
    def mpi_comm(self) -> Any:
        return self._comm

    def _mpi_op(self, op: str) -> Any:
        try:
            return self._ops[op]
        except KeyError:
            check_op(op)
            raise

    def allreduce_(self, buf: Any, op: str = "sum") -> None:
        # the hot path for every gradient bucket: kept to a dict lookup and a type check
        mop = self._ops.get(op) or self._mpi_op(op)
        self._count(buf)
        with flight.Op(self, "allreduce", buf.nbytes):
            if type(buf) is np.ndarray or not hasattr(buf, "__cuda_array_interface__"):
                stall.wait(self._comm.Iallreduce(self._in_place, buf, mop), "an allreduce")
            else:
                self._device_allreduce(buf, op, mop)

    def iallreduce_(self, buf: Any, op: str = "sum") -> Handle:
        mop = self._ops.get(op) or self._mpi_op(op)
        self._count(buf)
        record = flight.post(self, "allreduce", buf.nbytes)
        if type(buf) is np.ndarray or not hasattr(buf, "__cuda_array_interface__"):
            req = self._comm.Iallreduce(self._in_place, buf, mop)
            return flight.Tracked(MpiHandle(req, buf, "an allreduce"), record)
        return flight.Tracked(self._device_iallreduce(buf, op, mop), record)

    def bcast_(self, buf: Any, root: int = 0) -> None:
        if self.rank == root:
            self._count(buf)
        with flight.Op(self, "broadcast", buf.nbytes):
            if is_device_array(buf):
                self._device_bcast(buf, root)
            else:
                stall.wait(self._comm.Ibcast(buf, root=root), "a broadcast")

    def barrier(self) -> None:
        with flight.Op(self, "barrier"):
            stall.wait(self._comm.Ibarrier(), "a barrier")

    # -- device buffers: staged through pinned host memory (cuda.py overrides them) --------
    def _device_allreduce(self, buf: Any, op: str, mop: Any) -> None:
        dev = as_cupy(buf)
        if dev.size == 0:
            return
        slot = self._pool.acquire(dev.size, dev.dtype)
        _copy_out(dev, slot)
        stall.wait(self._comm.Iallreduce(self._in_place, slot.host, mop), "an allreduce")
        _copy_back(dev, slot, self._pool)

    def _device_iallreduce(self, buf: Any, op: str, mop: Any) -> Handle:
        dev = as_cupy(buf)
        if dev.size == 0:
            return DONE
        slot = self._pool.acquire(dev.size, dev.dtype)
        _copy_out(dev, slot)
        req = self._comm.Iallreduce(self._in_place, slot.host, mop)
        return _StagedHandle(req, dev, slot, self._pool)

    def _device_bcast(self, buf: Any, root: int) -> None:
        dev = as_cupy(buf)
        if dev.size == 0:
            return
        slot = self._pool.acquire(dev.size, dev.dtype)
        if self.rank == root:
            _copy_out(dev, slot)
        stall.wait(self._comm.Ibcast(slot.host, root=root), "a broadcast")
        if self.rank == root:
            self._pool.release(slot)
        else:
            _copy_back(dev, slot, self._pool)

    def isend(self, buf: Any, dest: int, tag: int = 0) -> Handle:
        self._count(buf)
        record = flight.post(self, "send", buf.nbytes, dest)
        if is_device_array(buf):
            return flight.Tracked(self._device_isend(buf, dest, tag), record)
        req = self._comm.Isend(buf, dest=dest, tag=tag)
        return flight.Tracked(MpiHandle(req, buf, f"a send to rank {dest}"), record)

    def recv_(self, buf: Any, source: int, tag: int = 0) -> None:
        with flight.Op(self, "receive", buf.nbytes, source):
            if is_device_array(buf):
                self._device_recv(buf, source, tag)
            else:
                what = f"a receive from rank {source}"
                stall.wait(self._comm.Irecv(buf, source=source, tag=tag), what)

    def _device_isend(self, buf: Any, dest: int, tag: int) -> Handle:
        dev = as_cupy(buf)
        slot = self._pool.acquire(dev.size, dev.dtype)
        _copy_out(dev, slot)
        return _StagedHandle(
            self._comm.Isend(slot.host, dest=dest, tag=tag), None, slot, self._pool
        )

    def _device_recv(self, buf: Any, source: int, tag: int) -> None:
        dev = as_cupy(buf)
        slot = self._pool.acquire(dev.size, dev.dtype)
        what = f"a receive from rank {source}"
        stall.wait(self._comm.Irecv(slot.host, source=source, tag=tag), what)
        _copy_back(dev, slot, self._pool)

    def allreduce_host(self, values: Any, op: str = "sum") -> np.ndarray:
        out = self._host_values(values)
        self._count(out)
        with flight.Op(self, "allreduce", out.nbytes):
            mop = self._mpi_op(op)
            stall.wait(self._comm.Iallreduce(self._in_place, out, mop), "an allreduce")
        return out

    def allgather_obj(self, obj: Any) -> list:
        return stall.allgather(self._comm, obj, "a barrier before gathering")

    def abort(self, code: int) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self._MPI.COMM_WORLD.Abort(code)
