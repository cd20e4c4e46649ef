"""May device buffers go to MPI here: a CUDA-aware library and a device the driver sees."""

import contextlib
import ctypes
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from xpnn.errors import UserError
from xpnn.runtime.world import library_name, loaded_libmpi


@dataclass
class CudaAwareness:
    aware: bool  # device buffers may go to MPI here
    reason: str
    library: bool = False  # the library is CUDA-aware, whether or not CUDA runs
    cuda_problem: str | None = None  # why CUDA cannot run


# cuInit's CUresult codes (cuda.h) that say what is missing; the driver names any other
_CUDA_INIT_PROBLEMS = {
    100: "no CUDA device (the driver reports CUDA_ERROR_NO_DEVICE)",
    34: "no CUDA driver (libcuda.so.1 is the toolkit's stub, not a driver)",
    35: "no usable CUDA driver (CUDA_ERROR_INSUFFICIENT_DRIVER)",
}


def cuda_runtime_problem(load: Callable[[str], Any] = ctypes.CDLL) -> str | None:
    """Why CUDA cannot run here, or None; asks ``libcuda.so.1`` as MPI libraries do (no CuPy)."""
    try:
        lib = load("libcuda.so.1")
    except OSError as exc:  # the loader's message, without its repeated library name
        text = str(exc)
        text = text.split(": ", 1)[1] if text.startswith("libcuda") and ": " in text else text
        return f"no CUDA driver (libcuda.so.1 cannot be loaded: {text})"
    try:
        code = int(lib.cuInit(0))
    except Exception as exc:  # a library that is not the driver at all
        return f"no CUDA driver (cuInit failed: {exc})"
    if code in _CUDA_INIT_PROBLEMS:
        return _CUDA_INIT_PROBLEMS[code]
    if code != 0:
        return f"CUDA driver failed to start (cuInit returned {_cuda_error_name(lib, code)})"
    count = ctypes.c_int(0)
    if (code := int(lib.cuDeviceGetCount(ctypes.byref(count)))) != 0:
        return f"no CUDA device (cuDeviceGetCount returned {_cuda_error_name(lib, code)})"
    return "no CUDA device (the driver sees 0 devices)" if count.value < 1 else None


def _cuda_error_name(lib: Any, code: int) -> str:
    name = ctypes.c_char_p()
    with contextlib.suppress(Exception):
        if int(lib.cuGetErrorName(code, ctypes.byref(name))) == 0 and name.value:
            return f"{name.value.decode()} ({code})"
    return str(code)


def read_alloc_kinds() -> str | None:
    with contextlib.suppress(Exception):
        from mpi4py import MPI

        info = MPI.COMM_WORLD.Get_info()
        try:
            return info.Get("mpi_memory_alloc_kinds") or None
        finally:
            info.Free()
    return None


def _loaded_libmpi() -> ctypes.CDLL | None:
    """The MPI library mpi4py loaded, else the one mpi4py's own loader opens."""
    if (lib := loaded_libmpi()) is not None:
        return lib
    with contextlib.suppress(Exception):
        from mpi4py import _mpiabi  # private, but the loader mpi4py itself used

        return _mpiabi._dlopen_libmpi()
    return None


def query_mpix_cuda_support() -> int | None:
    try:
        from mpi4py import MPI  # noqa: F401  (loads and initialises libmpi)
    except Exception:
        return None
    func = getattr(_loaded_libmpi(), "MPIX_Query_cuda_support", None)
    if func is None:
        return None
    func.restype, func.argtypes = ctypes.c_int, []
    return int(func())


def detect_cuda_aware(
    env: Mapping[str, str] | None = None,
    alloc_kinds: str | None | Callable[[], str | None] = read_alloc_kinds,
    query_cuda_support: Callable[[], int | None] | None = query_mpix_cuda_support,
    cuda_problem: Callable[[], str | None] = cuda_runtime_problem,
) -> CudaAwareness:
    """Whether device buffers may be handed to MPI; ``alloc_kinds``: a value or a callable."""
    env = os.environ if env is None else env
    library = _library_cuda_aware(env, alloc_kinds, query_cuda_support)
    problem = cuda_problem() if library.aware else None
    if problem is None:
        return library
    why = f"the library is CUDA-aware ({library.reason}) but device buffers cannot be used here"
    return CudaAwareness(False, f"{why}: {problem}", library=True, cuda_problem=problem)


def _library_cuda_aware(env: Mapping[str, str], alloc_kinds: Any, query: Any) -> CudaAwareness:
    """The library alone: ``XPNN_CUDA_AWARE``, else an alloc kind, else the MPIX query."""
    if override := env.get("XPNN_CUDA_AWARE", "").strip():
        if override not in ("0", "1"):
            raise UserError(f"XPNN_CUDA_AWARE={override}: use 0 (not CUDA-aware) or 1 (aware)")
        return CudaAwareness(override == "1", f"XPNN_CUDA_AWARE={override}", override == "1")
    kinds = alloc_kinds() if callable(alloc_kinds) else alloc_kinds
    parts = [kind.strip().partition(":") for kind in (kinds or "").split(",")]
    # ``cuda`` or ``cuda:...device...``; ``cuda:host`` alone is pinned host memory
    if any(
        n.lower() == "cuda" and (not r or "device" in r.lower().split(":")) for n, _, r in parts
    ):
        return CudaAwareness(True, f"mpi_memory_alloc_kinds={kinds}", True)
    note = f"mpi_memory_alloc_kinds={kinds} (no cuda)" if kinds else "no mpi_memory_alloc_kinds"
    name = "MPIX_Query_cuda_support"
    try:
        support = query() if query is not None else None
        said = f"no {name}" if support is None else f"{name}() = {support}"
    except Exception as exc:  # a broken library must not stop training: stage through host
        support, said = None, f"{name} failed: {exc}"
    return CudaAwareness(True, said, True) if support else CudaAwareness(False, f"{note}; {said}")


def nonblocking_device_collectives(library_version: str) -> bool:
    """Open MPI's CUDA support covers only point-to-point and blocking collectives (its FAQ)."""
    return not library_version.lstrip().startswith("Open MPI")


def mpi_info() -> dict:
    """MPI facts for ``python -m xpnn info`` (starts MPI)."""
    import mpi4py
    from mpi4py import MPI

    awareness = detect_cuda_aware()
    try:
        query = query_mpix_cuda_support()
    except Exception as exc:  # shown as is: info must not fail on a broken library
        query = f"failed: {exc}"
    problem = awareness.cuda_problem if awareness.library else cuda_runtime_problem()
    return {
        "mpi4py": mpi4py.__version__,
        "library": library_name(MPI.Get_library_version()),
        "mpi_version": "{}.{}".format(*MPI.Get_version()),
        "alloc_kinds": read_alloc_kinds(),
        "mpix_query_cuda_support": query,
        "library_cuda_aware": awareness.library,
        "cuda_runtime": problem or "usable",
        "cuda_aware": awareness.aware,
        "cuda_aware_reason": awareness.reason,
    }
