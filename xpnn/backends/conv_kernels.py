"""Generic convolution, pooling and dropout kernels (filled in by the CNN work)."""

from __future__ import annotations


class ConvKernels:
    """Generic ``xp`` versions of im2col/col2im, max-pooling and dropout masks."""
