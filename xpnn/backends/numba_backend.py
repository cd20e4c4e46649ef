"""NumPy arrays with Numba-compiled fused kernels."""

from __future__ import annotations

import numpy as np

from xpnn.backends.base import Backend


class NumbaBackend(Backend):
    """CPU backend whose memory-bound kernels are compiled, threaded loops."""

    name = "numba"

    def __init__(self, dtype: str = "float32") -> None:
        from xpnn.backends.numba_kernels import NumbaKernels

        super().__init__(np, NumbaKernels(np), dtype)
