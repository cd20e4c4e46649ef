"""Numba convolution, pooling and dropout kernels (filled in by the CNN work)."""

from __future__ import annotations

from xpnn.backends.kernels import NumpyKernels


class NumbaConvKernels(NumpyKernels):
    """Numba overrides of the convolution kernels; falls back to the generic ones."""
