"""Freed host arrays kept for the next step: glibc returns big blocks to the kernel, and they
fault in again, zero-filled (200 to 560 faults a CNN step; docs/decisions/host-malloc.md)."""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
KEPT_BYTES = 256 << 20  # blocks up to this size come from the heap; this much free is kept
USER_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")

_done = False


def keep_freed_arrays() -> bool:
    """Raise glibc's mmap and trim thresholds once a process unless the user set malloc's;
    True where raised."""
    global _done
    if _done or any(var in os.environ for var in USER_VARS):
        return False
    _done = True
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):  # no C library by that name (Windows)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, KEPT_BYTES) and mallopt(M_TRIM_THRESHOLD, KEPT_BYTES))
