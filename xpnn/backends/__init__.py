"""Backends, one per array library; ``get_backend`` is the only way the rest of xpnn gets one."""

import contextlib
import ctypes
import glob
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from xpnn.backends.base import Backend
from xpnn.backends.common import StepScalars
from xpnn.backends.cupy_backend import CupyBackend, import_cupy
from xpnn.backends.numpy_kernels import NumpyKernels
from xpnn.backends.torch_backend import TorchBackend, import_torch, resolve_device
from xpnn.errors import UserError

BACKENDS = ("numpy", "numba", "cupy", "torch", "auto")
THRESHOLDS = (-3, -1)  # glibc's mallopt M_MMAP_THRESHOLD and M_TRIM_THRESHOLD (malloc.h)
KEPT_BYTES = 256 << 20  # blocks up to this size come from the heap; this much free is kept
USER_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
# What users export to limit threads; threadpoolctl's limits and Numba's count override them
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
# what this process set: the thread count and threadpoolctl's limits keeping it, freed arrays kept
_APPLIED: dict[str, Any] = {}


def get_backend(
    name: str, dtype: str = "float32", device_id: int = 0, device: str | None = None
) -> Backend:
    """``auto``: CuPy on a usable GPU, else PyTorch on an accelerator, else Numba."""
    if not (threads_set() or any(os.environ.get(var) for var in THREAD_VARS)):
        set_threads()  # the first backend of a process limits BLAS's and Numba's threads
    if device is not None and name != "torch":
        raise UserError(f"`device` {device}: only for `backend` torch (not {name})")
    if name == "auto":
        name = "cupy" if gpu_unavailable_reason() is None else auto_without_cupy()
    if name in ("numpy", "numba"):
        keep_freed_arrays()  # a CPU step's temporaries reused without page faults
        table = NumpyKernels
        if name == "numba":  # the memory-bound kernels compiled into threaded loops
            from xpnn.backends.numba_kernels import NumbaKernels as table
        backend = Backend(np, table(np), dtype)
        backend.name = name
        return backend
    if name == "cupy":
        return CupyBackend(dtype, device_id)
    if name == "torch":
        return TorchBackend(dtype, device, device_id)
    raise UserError(f"`backend`: unknown backend {name!r} (choose {', '.join(BACKENDS)})")


def keep_freed_arrays() -> bool:
    """Raise glibc's mmap and trim thresholds once (docs/decisions/host-malloc.md); True if so."""
    if "kept" in _APPLIED or any(var in os.environ for var in USER_VARS):
        return False
    _APPLIED["kept"] = True
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):  # no C library by that name (Windows)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(threshold, KEPT_BYTES) for threshold in THRESHOLDS)


def _reason(load: Callable[[], object]) -> str | None:
    try:
        load()
    except UserError as exc:
        return str(exc).partition(": ")[2]
    return None


def gpu_unavailable_reason() -> str | None:
    """None when CuPy and a CUDA device are usable, else the one-line reason why not."""
    return _reason(import_cupy)


def availability() -> dict[str, str | None]:
    """Each concrete backend -> None if usable, else why not (for ``xpnn info``)."""
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
    return "numba" if resolve_device(import_torch()[0], "auto").type == "cpu" else "torch"


def accelerator_possible() -> bool:
    """False only on Linux without NVIDIA's, AMD's (ROCm) or a render driver's (XPU) devices."""
    if not sys.platform.startswith("linux"):
        return True
    return any(glob.glob(pattern) for pattern in ("/dev/nvidia*", "/dev/kfd", "/dev/dri/renderD*"))


def set_threads(n: int | None = None) -> dict:
    """Limit BLAS/OpenMP and Numba (by environment unless imported: 0.5 s) to ``n`` threads."""
    if n is None:  # the cores this process may run on (its affinity mask: cgroups, taskset)
        try:
            n = max(1, len(os.sched_getaffinity(0)))
        except (AttributeError, OSError):
            n = os.cpu_count() or 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise UserError(f"`threads` {n}: must be a whole number >= 1")
    os.environ["OMP_NUM_THREADS"] = str(n)
    if "numba" in sys.modules:
        import numba

        numba_threads = min(n, numba.config.NUMBA_NUM_THREADS)
        numba.set_num_threads(numba_threads)
    else:
        os.environ["NUMBA_NUM_THREADS"] = str(n)
        numba_threads = n
    # after Numba: starting its threading layer may load an OpenMP runtime to limit as well
    blas: list[dict] = []
    with contextlib.suppress(ImportError):
        from threadpoolctl import threadpool_info, threadpool_limits

        _APPLIED["limiter"] = threadpool_limits(limits=n)
        keys = {"lib": "internal_api", "api": "user_api", "threads": "num_threads"}
        blas = [{k: pool.get(v) for k, v in keys.items()} for pool in threadpool_info()]
    _APPLIED["threads"] = n
    return {"threads": n, "blas": blas, "numba": numba_threads}


def threads_set() -> int | None:
    """The count ``set_threads`` gave this process, or None."""
    return _APPLIED.get("threads")


__all__ = ["Backend", "BACKENDS", "get_backend", "availability", "gpu_unavailable_reason"]
__all__ += ["StepScalars", "set_threads"]
