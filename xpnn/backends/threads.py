"""BLAS, OpenMP and Numba held to one thread count per process (else each takes every core)."""

import contextlib
import os
import sys
from typing import Any

from xpnn.errors import UserError

# What users export to limit threads; threadpoolctl's limits and Numba's count override them
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
_APPLIED: dict[str, Any] = {}  # once set: the count, and the threadpoolctl limits keeping it


def set_threads(n: int | None = None) -> dict:
    """Limit BLAS/OpenMP and Numba (by environment unless imported: 0.5 s) to ``n`` threads."""
    n = default_threads() if n is None else n
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


def default_threads() -> int:
    """The cores this process may run on (its affinity mask: cgroups, taskset, binding)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
