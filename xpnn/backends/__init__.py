"""Backends, one per array library; ``get_backend`` is the only way the rest of xpnn gets one."""

from __future__ import annotations

import glob
import importlib.util
import sys
from collections.abc import Callable

from xpnn.backends.base import Backend, cpu_backend
from xpnn.backends.graphs import StepScalars
from xpnn.backends.host_memory import keep_freed_arrays
from xpnn.backends.threads import set_threads, set_threads_once
from xpnn.errors import UserError

BACKENDS = ("numpy", "numba", "cupy", "torch", "auto")


def get_backend(
    name: str, dtype: str = "float32", device_id: int = 0, device: str | None = None
) -> Backend:
    """``auto``: CuPy on a usable GPU, else PyTorch where it sees an accelerator, else Numba.
    ``device``: torch's; ``device_id``: the GPU this rank takes when none is named."""
    set_threads_once()  # the first backend of a process limits BLAS's and Numba's threads
    if device is not None and name != "torch":
        raise UserError(f"`device` {device}: only for `backend` torch (not {name})")
    if name == "auto":
        name = "cupy" if gpu_unavailable_reason() is None else auto_without_cupy()
    if name in ("numpy", "numba"):
        keep_freed_arrays()  # a CPU step's temporaries reused without page faults
        return cpu_backend(name, dtype)
    if name == "cupy":
        from xpnn.backends.cupy_backend import CupyBackend

        return CupyBackend(dtype, device_id)
    if name == "torch":
        from xpnn.backends.torch_backend import TorchBackend

        return TorchBackend(dtype, device, device_id)
    raise UserError(f"`backend`: unknown backend {name!r} (choose {', '.join(BACKENDS)})")


def _reason(load: Callable[[], object]) -> str | None:
    try:
        load()
    except UserError as exc:
        return str(exc).partition(": ")[2]
    return None


def gpu_unavailable_reason() -> str | None:
    """None when CuPy and a CUDA device are usable, else the one-line reason why not."""
    from xpnn.backends.cupy_backend import import_cupy

    return _reason(import_cupy)


def availability() -> dict[str, str | None]:
    """Each concrete backend -> None if usable, else why not (for ``xpnn info``)."""
    from xpnn.backends.torch_backend import import_torch

    out: dict[str, str | None] = {"numpy": None, "numba": None}
    try:
        import numba  # noqa: F401
    except ImportError as exc:
        out["numba"] = f"Numba is not installed ({exc})"
    return out | {"cupy": gpu_unavailable_reason(), "torch": _reason(import_torch)}


def auto_without_cupy() -> str:
    """``torch`` where PyTorch (with array-api-compat) sees an accelerator, else ``numba``."""
    modules = ("torch", "array_api_compat")
    # importing PyTorch costs each rank a second or more
    if not accelerator_possible() or not all(importlib.util.find_spec(m) for m in modules):
        return "numba"
    from xpnn.backends.torch_backend import import_torch, resolve_device

    return "numba" if resolve_device(import_torch()[0], "auto").type == "cpu" else "torch"


def accelerator_possible() -> bool:
    """False only on Linux without the device files of NVIDIA's, AMD's (ROCm) or a render
    driver (Intel's XPU); elsewhere (macOS: MPS) True."""
    if not sys.platform.startswith("linux"):
        return True
    return any(glob.glob(pattern) for pattern in ("/dev/nvidia*", "/dev/kfd", "/dev/dri/renderD*"))


__all__ = ["Backend", "BACKENDS", "get_backend", "availability", "gpu_unavailable_reason"]
__all__ += ["StepScalars", "set_threads"]
