"""Backends: one per array library. ``get_backend`` is the only way the rest of xpnn gets one."""

from __future__ import annotations

from xpnn.backends.base import Backend, NumbaBackend, NumpyBackend
from xpnn.backends.graphs import StepScalars
from xpnn.backends.host_memory import keep_freed_arrays
from xpnn.backends.threads import set_threads, set_threads_once
from xpnn.errors import UserError

BACKENDS = ("numpy", "numba", "cupy", "torch", "auto")


def get_backend(
    name: str, dtype: str = "float32", device_id: int = 0, device: str | None = None
) -> Backend:
    """Build the named backend; ``auto`` is CuPy where a GPU is usable, else PyTorch where it
    sees an accelerator, else Numba. ``device`` (torch only): auto, cpu, cuda, mps, xpu or a
    torch device string; ``device_id``: the GPU this rank takes when none is named. The first
    backend of a process limits BLAS's and Numba's threads, as the command line does."""
    set_threads_once()
    if device is not None and name != "torch":
        raise UserError(f"`device` {device}: only for `backend` torch (not {name})")
    if name == "auto":
        name = "cupy" if gpu_unavailable_reason() is None else auto_without_cupy()
    if name in ("numpy", "numba"):
        keep_freed_arrays()  # a CPU step's temporaries reused without page faults
        return NumpyBackend(dtype) if name == "numpy" else NumbaBackend(dtype)
    if name == "cupy":
        from xpnn.backends.cupy_backend import CupyBackend

        return CupyBackend(dtype, device_id)
    if name == "torch":
        from xpnn.backends.torch_backend import TorchBackend

        return TorchBackend(dtype, device, device_id)
    raise UserError(f"`backend`: unknown backend {name!r} (choose {', '.join(BACKENDS)})")


def gpu_unavailable_reason() -> str | None:
    """None when CuPy and a CUDA device are usable, else the one-line reason why not."""
    from xpnn.backends.cupy_backend import import_cupy

    try:
        import_cupy()
    except UserError as exc:
        return str(exc).removeprefix("`backend` cupy: ")
    return None


def availability() -> dict[str, str | None]:
    """Each concrete backend -> None if usable, else why not (for ``xpnn info``)."""
    out: dict[str, str | None] = {"numpy": None}
    try:
        import numba  # noqa: F401

        out["numba"] = None
    except ImportError as exc:
        out["numba"] = f"Numba is not installed ({exc})"
    out["cupy"] = gpu_unavailable_reason()
    out["torch"] = torch_unavailable_reason()
    return out


def auto_without_cupy() -> str:
    """``torch`` where PyTorch (with array-api-compat) sees an accelerator, else ``numba``."""
    import importlib.util

    if not accelerator_possible():  # importing PyTorch costs each rank a second or more
        return "numba"
    if not all(importlib.util.find_spec(m) for m in ("torch", "array_api_compat")):
        return "numba"
    from xpnn.backends.torch_backend import ACCELERATORS, device_count, import_torch

    torch, _ = import_torch()
    return "torch" if any(device_count(torch, kind) for kind in ACCELERATORS) else "numba"


def accelerator_possible() -> bool:
    """False only where no device PyTorch could use exists: Linux without the device files of
    NVIDIA's, AMD's (ROCm) or a render driver (Intel's XPU); elsewhere (macOS: MPS) True."""
    import glob
    import sys

    if not sys.platform.startswith("linux"):
        return True
    return any(glob.glob(pattern) for pattern in ("/dev/nvidia*", "/dev/kfd", "/dev/dri/renderD*"))


def torch_unavailable_reason() -> str | None:
    """None when PyTorch and array-api-compat import, else the one-line reason why not."""
    from xpnn.backends.torch_backend import import_torch

    try:
        import_torch()
    except UserError as exc:
        return str(exc).removeprefix("`backend` torch: ")
    return None


__all__ = ["Backend", "BACKENDS", "get_backend", "availability", "gpu_unavailable_reason"]
__all__ += ["StepScalars", "set_threads"]
