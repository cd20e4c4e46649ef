"""The array libraries' thread pools (BLAS, OpenMP, Numba) held to one count per process: left
alone, Numba's and OpenBLAS's pools each start a thread per core and fight over the cores."""

from __future__ import annotations

import os
import sys

from xpnn.errors import UserError

# What users export to limit threads; threadpoolctl's limits and Numba's count override them
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
_LIMITER: object | None = None  # the live threadpoolctl controller; kept so limits stay applied
_APPLIED: list[int] = []  # the count set in this process, once set


def set_threads(n: int | None = None) -> dict:
    """Limit BLAS/OpenMP pools and Numba to ``n`` threads (default: the cores this process may
    run on); report what was limited. Numba is limited through the environment unless
    imported: importing it costs 0.5 s."""
    global _LIMITER
    if n is None:
        n = default_threads()
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
    try:
        from threadpoolctl import threadpool_info, threadpool_limits

        _LIMITER = threadpool_limits(limits=n)
        keys = {"lib": "internal_api", "api": "user_api", "threads": "num_threads"}
        blas = [{k: pool.get(v) for k, v in keys.items()} for pool in threadpool_info()]
    except ImportError:
        pass
    _APPLIED[:] = [n]
    return {"threads": n, "blas": blas, "numba": numba_threads}


def threads_set() -> int | None:
    """The count ``set_threads`` gave this process, or None."""
    return _APPLIED[0] if _APPLIED else None


def set_threads_once() -> None:
    """``set_threads()`` unless this process set a count already or its user exported one."""
    if _APPLIED or any(os.environ.get(var) for var in THREAD_VARS):
        return
    set_threads()


def default_threads() -> int:
    """The cores this process may run on (its affinity mask: cgroups, taskset, binding)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
