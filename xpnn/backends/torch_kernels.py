"""PyTorch's kernels: the generic ones, hashing dropout in int64 (PyTorch has no uint32
arithmetic) and overriding only what measured faster on torch."""

from __future__ import annotations

from xpnn.backends.kernels import Kernels


class TorchKernels(Kernels):
    """The array-API reference on ``array_api_compat.torch``."""

    HASH_DTYPE = "int64"
