"""What a communicator needs of CuPy's and PyTorch's device buffers, imported when one comes."""

from functools import cache
from typing import Any

import numpy as np


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


@cache
def _numpy_dtype(torch_dtype: Any) -> np.dtype:
    import torch

    return torch.empty(0, dtype=torch_dtype, device="cpu").numpy().dtype


CUPY = CupyArrays()
TORCH = TorchArrays()
Arrays = CupyArrays | TorchArrays


def arrays_of(library: str) -> Arrays:
    """The device-buffer handling for a backend's ``array_library`` (NumPy's has none)."""
    return TORCH if library == "torch" else CUPY
