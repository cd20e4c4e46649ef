"""MPI on host memory (``mpi-host``); CuPy's and PyTorch's device buffers staged via pinned ones."""

import functools
import sys
from types import SimpleNamespace
from typing import Any

import numpy as np

from xpnn.parallel.comm.base import DONE, Communicator, Handle, check_counts, check_op
from xpnn.parallel.comm.narrow import sum_op
from xpnn.record import phases
from xpnn.runtime import flight, stall


class CupyArrays:
    """CuPy arrays (and any array carrying ``__cuda_array_interface__``) on the current device."""

    library = "cupy"

    def is_device(self, buf: Any) -> bool:
        return type(buf) is not np.ndarray and hasattr(buf, "__cuda_array_interface__")

    def flat(self, buf: Any) -> Any:
        import cupy

        dev = buf if isinstance(buf, cupy.ndarray) else cupy.asarray(buf)
        if not dev.flags.c_contiguous:
            raise ValueError("communication buffers must be contiguous")
        return dev if dev.ndim == 1 else dev.reshape(-1)

    def host_dtype(self, dev: Any) -> np.dtype:
        return np.dtype(dev.dtype)

    def empty_pinned(self, size: int, dtype: np.dtype) -> np.ndarray:
        """Page-locked: device copies run at full PCIe speed."""
        import cupyx

        return cupyx.empty_pinned((size,), dtype=dtype)

    def copy_out(self, dev: Any, host: np.ndarray) -> None:
        """Device to host, after the work queued on the current stream."""
        import cupy

        dev.get(stream=cupy.cuda.get_current_stream(), out=host, blocking=True)

    def copy_back(self, dev: Any, host: np.ndarray) -> Any:
        """Host to device, queued on the current stream; the event that ends it."""
        import cupy

        stream = cupy.cuda.get_current_stream()
        dev.set(host, stream=stream)
        return stream.record()

    def wait_for_stream(self) -> None:
        """MPI does not know streams: wait for the current one."""
        import cupy

        cupy.cuda.get_current_stream().synchronize()


class TorchArrays:
    """PyTorch tensors: a CPU one is a host buffer (MPI reads it by DLPack), others device ones."""

    library = "torch"

    def is_device(self, buf: Any) -> bool:
        device = getattr(buf, "device", None)
        return type(buf) is not np.ndarray and device is not None and device.type != "cpu"

    def flat(self, buf: Any) -> Any:
        if not buf.is_contiguous():
            raise ValueError("communication buffers must be contiguous")
        return buf.reshape(-1)

    def host_dtype(self, dev: Any) -> np.dtype:
        return _numpy_dtype(dev.dtype)

    def empty_pinned(self, size: int, dtype: np.dtype) -> np.ndarray:
        """Page-locked where PyTorch has an accelerator to lock it for, else plain (MPS)."""
        import torch

        wanted = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
        try:
            return torch.empty(size, dtype=wanted, pin_memory=True).numpy()
        except RuntimeError:  # no accelerator that pins memory
            return np.empty(size, dtype=dtype)

    def copy_out(self, dev: Any, host: np.ndarray) -> None:
        import torch

        torch.from_numpy(host).copy_(dev)  # blocking: after the work queued before it

    def copy_back(self, dev: Any, host: np.ndarray) -> Any:
        """Host to device: queued on the current CUDA stream (its event returned), else blocking."""
        import torch

        if dev.device.type != "cuda":
            dev.copy_(torch.from_numpy(host))
            return None
        dev.copy_(torch.from_numpy(host), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return event

    def wait_for_stream(self) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()


@functools.cache
def _numpy_dtype(torch_dtype: Any) -> np.dtype:
    import torch

    return torch.empty(0, dtype=torch_dtype, device="cpu").numpy().dtype


CUPY = CupyArrays()
TORCH = TorchArrays()
Arrays = CupyArrays | TorchArrays


def arrays_of(library: str) -> Arrays:
    """The device-buffer handling for a backend's ``array_library`` (NumPy's has none)."""
    return TORCH if library == "torch" else CUPY


class MpiHandle:
    """An MPI request, its buffer (alive until done) and what it is, for stall warnings."""

    __slots__ = ("_req", "_buf", "_what")

    def __init__(self, req: Any, buf: Any, what: str = "a transfer") -> None:
        self._req, self._buf, self._what = req, buf, what

    def wait(self) -> None:
        if self._req is not None:
            stall.wait(self._req, self._what)
            self._req = self._buf = None


class _PinnedPool:
    """Pinned host buffers per (size, dtype), reused once their copy back to the device is done."""

    def __init__(self, arrays: Arrays) -> None:
        self._arrays = arrays
        self._free: dict[tuple[int, np.dtype], list[tuple[np.ndarray, Any]]] = {}  # (host, event)
        self.allocated = 0

    def host_for(self, dev: Any) -> np.ndarray:
        size, dtype = dev.shape[0], self._arrays.host_dtype(dev)  # ``dev``: flat
        free = self._free.get((size, dtype))
        if not free:
            self.allocated += 1
            return self._arrays.empty_pinned(size, dtype)
        host, event = free.pop()
        if event is not None:  # the end of its last host-to-device copy
            event.synchronize()
        return host

    def copy_out(self, dev: Any) -> np.ndarray:
        host = self.host_for(dev)
        with phases.span("device to host", phases.COPIES):
            self._arrays.copy_out(dev, host)
        return host

    def give_back(self, host: np.ndarray, dev: Any = None) -> None:
        """``host`` back to the pool, copied into ``dev`` first (None: a send, a broadcast root)."""
        event = None
        if dev is not None:
            with phases.span("host to device (queued)", phases.COPIES):
                event = self._arrays.copy_back(dev, host)
        self._free.setdefault((host.size, host.dtype), []).append((host, event))


class _StagedHandle(MpiHandle):
    """A request on pinned ``host``, copied back to ``dev`` at ``wait`` (``dev`` None: a send)."""

    __slots__ = ("_dev", "_host", "_pool")

    def __init__(self, req: Any, dev: Any, host: np.ndarray, pool: _PinnedPool, what: str) -> None:
        super().__init__(req, None, what)
        self._dev, self._host, self._pool = dev, host, pool

    def wait(self) -> None:
        if self._req is None:
            return
        super().wait()
        self._pool.give_back(self._host, self._dev)
        self._dev = self._host = None


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
        host = self._pool.copy_out(dev)
        staged = _StagedHandle(post(host, starts, counts), dev, host, self._pool, what)
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
        host = self._pool.copy_out(dev)
        req = self.mpi_comm.Iallreduce(self._in_place, host, mop)
        return _StagedHandle(req, dev, host, self._pool, "an allreduce")

    def _device_bcast(self, buf: Any, root: int) -> None:
        dev = self._arrays.flat(buf)
        if not dev.shape[0]:
            return
        host = self._pool.copy_out(dev) if self.rank == root else self._pool.host_for(dev)
        stall.wait(self.mpi_comm.Ibcast(host, root=root), "a broadcast")
        self._pool.give_back(host, None if self.rank == root else dev)

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
        host = self._pool.copy_out(self._arrays.flat(buf))
        req = self.mpi_comm.Isend(host, dest=dest, tag=tag)
        return _StagedHandle(req, None, host, self._pool, "a send")

    def _device_recv(self, buf: Any, source: int, tag: int) -> None:
        dev = self._arrays.flat(buf)
        host = self._pool.host_for(dev)
        what = f"a receive from rank {source}"
        stall.wait(self.mpi_comm.Irecv(host, source=source, tag=tag), what)
        self._pool.give_back(host, dev)

    def allgather_obj(self, obj: Any, what: str = "a barrier before gathering") -> list:
        return stall.allgather(self.mpi_comm, obj, what)

    def bcast_obj(self, obj: Any, root: int = 0, what: str = "a barrier before a broadcast") -> Any:
        stall.wait(self.mpi_comm.Ibarrier(), what)  # MPI has no non-blocking bcast of objects
        return self.mpi_comm.bcast(obj, root=root)

    def abort(self, code: int) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self._MPI.COMM_WORLD.Abort(code)
