"""Device-buffer communicators (CUDA-aware MPI, CuPy's NCCL) and the choice between them."""

import socket
import sys
from typing import Any

import numpy as np

from xpnn.errors import user_message
from xpnn.parallel.comm.base import DONE, Communicator, Handle
from xpnn.parallel.comm.cuda_aware import (
    CudaAwareness,
    detect_cuda_aware,
    nonblocking_device_collectives,
)
from xpnn.parallel.comm.mpi import CUPY, TORCH, Arrays, MpiHandle, MpiHostCommunicator
from xpnn.parallel.comm.narrow import check_narrow
from xpnn.runtime import flight
from xpnn.runtime.world import World


class MpiCudaCommunicator(MpiHostCommunicator):
    """Device buffers handed to a CUDA-aware MPI once the current stream is done."""

    name = "mpi-cuda"
    device_buffers = True

    def __init__(self, mpi_comm: Any, arrays: Arrays = CUPY) -> None:
        super().__init__(mpi_comm, arrays)
        self.nonblocking = nonblocking_device_collectives(self._MPI.Get_library_version())

    def _device_allreduce(self, buf: Any, op: str, mop: Any) -> None:
        self._arrays.wait_for_stream()
        self.mpi_comm.Allreduce(self._in_place, buf, mop)

    def _device_iallreduce(self, buf: Any, op: str, mop: Any) -> Handle:
        self._arrays.wait_for_stream()
        if not self.nonblocking:  # Open MPI: device buffers block
            self.mpi_comm.Allreduce(self._in_place, buf, mop)
            return DONE
        return MpiHandle(self.mpi_comm.Iallreduce(self._in_place, buf, mop), buf)

    def _device_bcast(self, buf: Any, root: int) -> None:
        self._arrays.wait_for_stream()
        self.mpi_comm.Bcast(buf, root=root)

    def barrier(self) -> None:
        self._arrays.wait_for_stream()
        with flight.Op(self, "barrier"):
            self.mpi_comm.Barrier()

    def _device_isend(self, buf: Any, dest: int, tag: int) -> Handle:
        self._arrays.wait_for_stream()
        return MpiHandle(self.mpi_comm.Isend(buf, dest=dest, tag=tag), buf)

    def _device_recv(self, buf: Any, source: int, tag: int) -> None:
        self._arrays.wait_for_stream()  # the buffer's allocation is stream-ordered
        self.mpi_comm.Recv(buf, source=source, tag=tag)


class _NcclHandle:
    """An NCCL reduction on its stream; ``wait`` orders the current stream after it, host free."""

    __slots__ = ("_event", "_buf")

    def __init__(self, event: Any, buf: Any) -> None:
        self._event, self._buf = event, buf

    def wait(self) -> None:
        if self._event is None:
            return
        import cupy

        cupy.cuda.get_current_stream().wait_event(self._event)
        self._event = self._buf = None


class NcclCommunicator(MpiHostCommunicator):
    """NCCL for device buffers (non-blocking ones on their own stream); MPI for the rest."""

    name = "nccl"
    device_buffers = True

    def __init__(self, mpi_comm: Any) -> None:
        super().__init__(mpi_comm)
        import cupy
        from cupy.cuda import nccl

        uid = mpi_comm.bcast(nccl.get_unique_id() if self.rank == 0 else None, root=0)
        self._nccl = nccl.NcclCommunicator(self.size, uid, self.rank)
        self._stream = cupy.cuda.Stream(non_blocking=True)
        self._nccl_ops = {op: getattr(nccl, f"NCCL_{op.upper()}") for op in ("sum", "max", "min")}
        types = "float16 float32 float64 int8 uint8 int32 uint32 int64 uint64".split()
        self._nccl_types = {np.dtype(t): getattr(nccl, f"NCCL_{t.upper()}") for t in types}
        bf16 = getattr(nccl, "NCCL_BFLOAT16", 9)  # 9 in nccl.h (2.10+); older CuPy lacks it
        self._nccl_types16 = {"float16": nccl.NCCL_FLOAT16, "bfloat16": bf16}

    def _nccl_type(self, dtype: np.dtype) -> int:
        if np.dtype(dtype) not in self._nccl_types:
            raise TypeError(f"NCCL cannot reduce dtype {dtype}")
        return self._nccl_types[np.dtype(dtype)]

    def _device_allreduce(self, buf: Any, op: str, mop: Any) -> None:
        import cupy

        dev, stream = CUPY.flat(buf), cupy.cuda.get_current_stream()
        ptr, nccl_type = dev.data.ptr, self._nccl_type(dev.dtype)
        self._nccl.allReduce(ptr, ptr, dev.size, nccl_type, self._nccl_ops[op], stream.ptr)

    def _device_iallreduce(self, buf: Any, op: str, mop: Any) -> Handle:
        dev = CUPY.flat(buf)
        return self._nccl_iallreduce(dev, self._nccl_type(dev.dtype), self._nccl_ops[op])

    def _nccl_iallreduce(self, dev: Any, nccl_type: int, nccl_op: int) -> Handle:
        import cupy

        ptr = dev.data.ptr
        self._stream.wait_event(cupy.cuda.get_current_stream().record())
        self._nccl.allReduce(ptr, ptr, dev.size, nccl_type, nccl_op, self._stream.ptr)
        return _NcclHandle(self._stream.record(), dev)

    def iallreduce_sum16_(self, bits: Any, dtype: str) -> Handle:
        # NCCL sums float16 and bfloat16 itself, on the device
        if not CUPY.is_device(bits):
            return super().iallreduce_sum16_(bits, dtype)
        check_narrow(dtype)
        self._count(bits)
        record = flight.post(self, "allreduce", bits.nbytes)
        nccl_type = self._nccl_types16[dtype]
        handle = self._nccl_iallreduce(CUPY.flat(bits), nccl_type, self._nccl_ops["sum"])
        return flight.Tracked(handle, record)

    def _device_bcast(self, buf: Any, root: int) -> None:
        import cupy

        dev = CUPY.flat(buf)
        stream = cupy.cuda.get_current_stream()
        self._nccl.bcast(dev.data.ptr, dev.size, self._nccl_type(dev.dtype), root, stream.ptr)

    def barrier(self) -> None:
        CUPY.wait_for_stream()
        self._stream.synchronize()
        with flight.Op(self, "barrier"):
            self.mpi_comm.Barrier()


def _info(device: int, gpu: str, nccl: bool, nccl_why: str, aware: Any = None) -> dict:
    aware = aware or detect_cuda_aware()
    host = socket.gethostname()
    facts = {"host": host, "device": device, "gpu": (host, gpu), "nccl": nccl}
    return {**facts, "nccl_why": nccl_why, "aware": aware.aware, "aware_why": aware.reason}


def _local_torch_info() -> dict:
    """A PyTorch device: CUDA (or ROCm) goes through MPI, aware or staged; MPS and XPU staged."""
    import torch

    no_nccl = "NCCL is reached through CuPy; backend torch uses MPI"
    if not torch.cuda.is_available():
        why = "a CUDA-aware MPI takes CUDA buffers only; this device's are staged via host"
        return _info(0, "0", False, no_nccl, CudaAwareness(False, why))
    device = int(torch.cuda.current_device())
    props = torch.cuda.get_device_properties(device)
    return _info(device, str(getattr(props, "uuid", device)), False, no_nccl)


def _local_gpu_info() -> dict:
    import cupy

    device = int(cupy.cuda.runtime.getDevice())
    try:
        bus = str(cupy.cuda.Device(device).pci_bus_id)
    except Exception:  # older CuPy: the device index is the best we have
        bus = f"device{device}"
    try:
        from cupy.cuda import nccl

        nccl_ok = bool(getattr(nccl, "available", True))
        nccl_why = "" if nccl_ok else "cupy.cuda.nccl is not available"
    except Exception as exc:
        nccl_ok, nccl_why = False, f"cupy.cuda.nccl failed to import: {exc}"
    return _info(device, bus, nccl_ok, nccl_why)


def shared_gpu(infos: list[dict]) -> tuple[int, int, int] | None:
    """The first two ranks that sit on the same physical GPU, and its device index, or None."""
    seen: dict[Any, int] = {}
    for rank, info in enumerate(infos):
        first = seen.setdefault(tuple(info["gpu"]), rank)
        if first != rank:
            return first, rank, infos[first]["device"]
    return None


def choose_gpu_kind(infos: list[dict], kind: str) -> tuple[str, str | None, str]:
    """(name, fallback reason, detail): auto is nccl, else mpi-cuda, else mpi-host."""
    aware = all(i["aware"] for i in infos)
    shared = shared_gpu(infos) if len(infos) > 1 else None
    not_aware = next((i["aware_why"] for i in infos if not i["aware"]), "")
    not_nccl = next((i["nccl_why"] for i in infos if not i["nccl"]), None)  # None: usable
    refused = not_nccl is None and shared is not None
    if refused:
        not_nccl = "ranks {} and {} share GPU {}".format(*shared)
    mpi_kind = "mpi-cuda" if aware else "mpi-host"
    if kind == "mpi-host":
        return "mpi-host", None, "requested"
    if kind == "mpi-cuda":
        if aware:
            return "mpi-cuda", None, "requested; " + infos[0]["aware_why"]
        reason = f"`comm` mpi-cuda: MPI is not CUDA-aware ({not_aware}); falling back to mpi-host"
        return "mpi-host", reason, reason
    if not_nccl is None:
        detail = "requested" if kind == "nccl" else "one GPU per rank and NCCL available"
        return "nccl", None, detail
    if kind == "nccl":
        why = f"{not_nccl} (NCCL refuses that)" if refused else not_nccl
        reason = f"`comm` nccl: {why}; falling back to {mpi_kind}"
        return mpi_kind, reason, reason
    why_mpi = f"MPI is not CUDA-aware ({not_aware}): staging via host"
    return mpi_kind, None, f"not nccl: {not_nccl}; {'MPI is CUDA-aware' if aware else why_mpi}"


def make_gpu_communicator(world: World, kind: str, arrays: Arrays = CUPY) -> Communicator:
    """Every rank's GPU facts gathered, one transport agreed and built (collective)."""
    comm = world.mpi_comm
    local = _local_torch_info() if arrays is TORCH else _local_gpu_info()
    infos = comm.allgather(local)  # type: ignore[union-attr]
    name, fallback, detail = choose_gpu_kind(infos, kind)
    if fallback and world.is_root:
        print(f"xpnn: {user_message(fallback)}", file=sys.stderr, flush=True)
    cls = MpiCudaCommunicator if name == "mpi-cuda" else MpiHostCommunicator
    result = NcclCommunicator(comm) if name == "nccl" else cls(comm, arrays)
    result.fallback_reason, result.detail = fallback, detail
    if kind == "auto" and name != "nccl":  # e.g. two ranks on one GPU, an MPI without CUDA
        result.auto_fallback = detail
    return result
