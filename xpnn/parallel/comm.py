"""Communicators: one interface for every transport of gradients and metrics.

``SelfCommunicator`` (one process, no MPI), ``MpiHostCommunicator`` (MPI on host memory;
device buffers are staged through reused pinned host buffers) here; ``MpiCudaCommunicator``
and ``NcclCommunicator`` (device buffers handed to a CUDA-aware MPI or to NCCL) live in
``cuda_comm`` so that CuPy is imported only when a GPU backend asks for them.

Buffers are reduced in place and must be contiguous arrays of the backend (numpy, or cupy /
anything with ``__cuda_array_interface__``). Non-blocking calls return a ``Handle``; after
``wait()`` the buffer holds the result for the host (numpy) or for work queued afterwards on
the current CUDA stream (device buffers).
"""

from __future__ import annotations

import sys
from typing import Any, Protocol

import numpy as np

from xpnn.errors import UserError
from xpnn.parallel import stall
from xpnn.parallel.world import World

OPS = ("sum", "max", "min")
KINDS = ("auto", "mpi-shm", "mpi-host", "mpi-cuda", "nccl", "self")


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


_DONE = DoneHandle()


class _MpiHandle:
    """An MPI request plus a reference to its buffer, so the buffer outlives the request, and
    what it is, for a stall warning."""

    __slots__ = ("_req", "_buf", "_what")

    def __init__(self, req: Any, buf: Any, what: str) -> None:
        self._req = req
        self._buf = buf
        self._what = what

    def wait(self) -> None:
        if self._req is not None:
            stall.wait(self._req, self._what)
            self._req = None
            self._buf = None


def _check_op(op: str) -> None:
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
    """

    name: str = "base"

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
        _check_op(op)

    def iallreduce_(self, buf: Any, op: str = "sum") -> Handle:
        _check_op(op)
        return _DONE

    def bcast_(self, buf: Any, root: int = 0) -> None:
        if root != 0:
            raise ValueError(f"bcast root {root} out of range for 1 rank")

    def barrier(self) -> None:
        pass

    def allreduce_host(self, values: Any, op: str = "sum") -> np.ndarray:
        _check_op(op)
        return self._host_values(values)

    def allgather_obj(self, obj: Any) -> list:
        return [obj]

    def abort(self, code: int) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.exit(code)


class _PinnedSlot:
    """One pinned host buffer and the event after which its last host-to-device copy is done."""

    __slots__ = ("host", "event")

    def __init__(self, host: np.ndarray) -> None:
        self.host = host
        self.event: Any = None


class _PinnedPool:
    """Pinned host buffers per (size, dtype), allocated once and reused across steps.

    Several buffers per key exist only while several non-blocking reductions of that shape are
    in flight at once (equal-sized gradient buckets); a returned buffer is reused only after
    its pending copy back to the device has completed.
    """

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
    """A page-locked NumPy array: device copies to and from it run at full PCIe speed."""
    try:
        import cupyx

        return cupyx.empty_pinned((size,), dtype=dtype)
    except (ImportError, AttributeError):
        import cupy

        mem = cupy.cuda.alloc_pinned_memory(max(1, size * dtype.itemsize))
        return np.frombuffer(mem, dtype=dtype, count=size)


def _as_cupy(buf: Any) -> Any:
    """A flat CuPy view of a contiguous device array (zero copy, ``__cuda_array_interface__``)."""
    import cupy

    dev = buf if isinstance(buf, cupy.ndarray) else cupy.asarray(buf)
    if not dev.flags.c_contiguous:
        raise ValueError("communication buffers must be contiguous")
    return dev if dev.ndim == 1 else dev.reshape(-1)


class _StagedHandle:
    """Non-blocking operation on a device buffer staged through a pinned host buffer: a
    reduction (the result is copied back to ``dev``) or a send (``dev`` None: nothing comes
    back, the host buffer is only returned to the pool)."""

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
    """Device to pinned host, after the work queued on the current stream (the gradients)."""
    import cupy

    dev.get(stream=cupy.cuda.get_current_stream(), out=slot.host, blocking=True)


def _copy_back(dev: Any, slot: _PinnedSlot, pool: _PinnedPool) -> None:
    """Queue the host-to-device copy on the current stream and return the buffer to the pool."""
    import cupy

    stream = cupy.cuda.get_current_stream()
    dev.set(slot.host, stream=stream)  # asynchronous from pinned memory; ordered on the stream
    slot.event = stream.record()
    pool.release(slot)


class MpiHostCommunicator(Communicator):
    """MPI on host memory: works with every MPI library, CUDA-aware or not.

    NumPy buffers go straight to ``Iallreduce(MPI.IN_PLACE, buf)``. Device buffers are copied
    to a pinned host buffer (kept in a pool, so pinned memory is allocated once per bucket
    shape), reduced there, and copied back on the current stream. Every call that waits for
    other ranks waits through ``stall.wait``: no spinning core, and a word when a rank stops.
    """

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
        """The underlying mpi4py communicator (a duplicate of COMM_WORLD)."""
        return self._comm

    def _mpi_op(self, op: str) -> Any:
        try:
            return self._ops[op]
        except KeyError:
            _check_op(op)
            raise

    # -- in-place collectives --------------------------------------------------------------
    def allreduce_(self, buf: Any, op: str = "sum") -> None:
        # the hot path for every gradient bucket: kept to a dict lookup and a type check
        mop = self._ops.get(op) or self._mpi_op(op)
        if type(buf) is np.ndarray or not hasattr(buf, "__cuda_array_interface__"):
            stall.wait(self._comm.Iallreduce(self._in_place, buf, mop), "an allreduce")
        else:
            self._device_allreduce(buf, op, mop)

    def iallreduce_(self, buf: Any, op: str = "sum") -> Handle:
        mop = self._ops.get(op) or self._mpi_op(op)
        if type(buf) is np.ndarray or not hasattr(buf, "__cuda_array_interface__"):
            return _MpiHandle(self._comm.Iallreduce(self._in_place, buf, mop), buf, "an allreduce")
        return self._device_iallreduce(buf, op, mop)

    def bcast_(self, buf: Any, root: int = 0) -> None:
        if is_device_array(buf):
            self._device_bcast(buf, root)
        else:
            stall.wait(self._comm.Ibcast(buf, root=root), "a broadcast")

    def barrier(self) -> None:
        stall.wait(self._comm.Ibarrier(), "a barrier")

    # -- device buffers: staged through pinned host memory (overridden by cuda_comm) --------
    def _device_allreduce(self, buf: Any, op: str, mop: Any) -> None:
        dev = _as_cupy(buf)
        if dev.size == 0:
            return
        slot = self._pool.acquire(dev.size, dev.dtype)
        _copy_out(dev, slot)
        stall.wait(self._comm.Iallreduce(self._in_place, slot.host, mop), "an allreduce")
        _copy_back(dev, slot, self._pool)

    def _device_iallreduce(self, buf: Any, op: str, mop: Any) -> Handle:
        dev = _as_cupy(buf)
        if dev.size == 0:
            return _DONE
        slot = self._pool.acquire(dev.size, dev.dtype)
        _copy_out(dev, slot)
        req = self._comm.Iallreduce(self._in_place, slot.host, mop)
        return _StagedHandle(req, dev, slot, self._pool)

    def _device_bcast(self, buf: Any, root: int) -> None:
        dev = _as_cupy(buf)
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

    # -- point to point (pipeline stages) ---------------------------------------------------
    def isend(self, buf: Any, dest: int, tag: int = 0) -> Handle:
        if is_device_array(buf):
            return self._device_isend(buf, dest, tag)
        return _MpiHandle(self._comm.Isend(buf, dest=dest, tag=tag), buf, f"a send to rank {dest}")

    def recv_(self, buf: Any, source: int, tag: int = 0) -> None:
        if is_device_array(buf):
            self._device_recv(buf, source, tag)
        else:
            what = f"a receive from rank {source}"
            stall.wait(self._comm.Irecv(buf, source=source, tag=tag), what)

    def _device_isend(self, buf: Any, dest: int, tag: int) -> Handle:
        dev = _as_cupy(buf)
        slot = self._pool.acquire(dev.size, dev.dtype)
        _copy_out(dev, slot)
        return _StagedHandle(
            self._comm.Isend(slot.host, dest=dest, tag=tag), None, slot, self._pool
        )

    def _device_recv(self, buf: Any, source: int, tag: int) -> None:
        dev = _as_cupy(buf)
        slot = self._pool.acquire(dev.size, dev.dtype)
        what = f"a receive from rank {source}"
        stall.wait(self._comm.Irecv(slot.host, source=source, tag=tag), what)
        _copy_back(dev, slot, self._pool)

    # -- small host data -------------------------------------------------------------------
    def allreduce_host(self, values: Any, op: str = "sum") -> np.ndarray:
        out = self._host_values(values)
        stall.wait(self._comm.Iallreduce(self._in_place, out, self._mpi_op(op)), "an allreduce")
        return out

    def allgather_obj(self, obj: Any) -> list:
        # MPI has no non-blocking gather of objects: the barrier is where ranks wait
        stall.wait(self._comm.Ibarrier(), "a barrier before gathering")
        return self._comm.allgather(obj)

    def abort(self, code: int) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self._MPI.COMM_WORLD.Abort(code)


def make_communicator(
    world: World, backend: Any, kind: str = "auto", parallel: str = "data"
) -> Communicator:
    """The communicator for ``--comm kind`` on this backend; collective on every rank.

    One process without MPI always gets ``self``; with MPI started and one rank, ``auto``
    gives ``self`` while an explicit transport is honoured (handy for benchmarks). CPU
    backends: ``auto`` is ``mpi-shm`` (node-shared parameters) for data parallelism when every
    node holds the same number of ranks, else ``mpi-host`` (tensor and pipeline parallelism
    share no parameters between ranks); device transports are a user error. GPU backends:
    ``auto`` prefers NCCL (one GPU per rank), then CUDA-aware MPI, then host staging; an
    explicit request that cannot work falls back with one line on rank 0's stderr.
    """
    if kind not in KINDS:
        raise UserError(f"--comm {kind}: choose one of {', '.join(KINDS)}")
    is_gpu = bool(getattr(backend, "is_gpu", False))
    if not is_gpu and kind in ("mpi-cuda", "nccl"):
        raise UserError(f"--comm {kind}: needs --backend cupy")
    if is_gpu and kind == "mpi-shm":
        raise UserError("--comm mpi-shm: needs a CPU backend (numpy or numba)")
    if kind == "mpi-shm" and parallel != "data":
        raise UserError(
            f"--comm mpi-shm: shares one copy of the parameters between data-parallel ranks; "
            f"with --parallel {parallel} use mpi-host or auto, or --model-ranks K below the "
            "rank count for data-parallel replicas"
        )
    if kind == "self":
        if world.size > 1:
            raise UserError(f"--comm self: only for a single process, this job has {world.size}")
        return SelfCommunicator()
    if world.mpi_comm is None or (world.size == 1 and kind == "auto"):
        return SelfCommunicator()
    if not is_gpu:
        return _cpu_communicator(world, kind, parallel)
    from xpnn.parallel.cuda_comm import make_gpu_communicator

    return make_gpu_communicator(world, kind)


def _cpu_communicator(world: World, kind: str, parallel: str) -> Communicator:
    if parallel != "data":
        reason = "mpi-shm is for --parallel data only"
    elif kind in ("auto", "mpi-shm"):
        from xpnn.parallel.shm_comm import ShmCommunicator, forced_ranks_per_node

        forced_ranks_per_node()  # a typo there is the user's to fix, not a reason to fall back
        try:
            return ShmCommunicator.create(world.mpi_comm)
        except UserError as exc:
            if kind == "mpi-shm":
                raise
            reason = str(exc)
    comm = MpiHostCommunicator(world.mpi_comm)
    comm.detail = "host buffers" if kind == "mpi-host" else f"host buffers ({reason})"
    if kind == "auto" and parallel == "data":
        comm.auto_fallback = f"not mpi-shm: {reason.removeprefix('--comm mpi-shm: ')}"
    return comm
