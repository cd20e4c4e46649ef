"""What every backend's kernels share: dtype kinds, convolution geometry, the dropout hash."""

import math
from typing import Any

Array = Any
OutHW = tuple[int, int] | None
ACTIVATIONS = ("relu", "sigmoid", "tanh", "identity")
_KINDS = {"integral": ("iu", "int"), "real floating": ("f", "float")}  # (letters, name)


def dtype_is(dtype: Any, kind: str) -> bool:
    """Whether ``dtype`` is ``"integral"`` or ``"real floating"``, by kind letter or by name."""
    letters, name = _KINDS[kind]
    letter = getattr(dtype, "kind", None)
    return name in str(dtype) if letter is None else letter in letters


# -- the dropout hash: murmur3's 32-bit finaliser, chained over the keys ---------------------
MASK32 = 0xFFFFFFFF
FMIX_M1 = 0x85EBCA6B
FMIX_M2 = 0xC2B2AE35
GOLDEN = 0x9E3779B9


def fmix32_host(h: int) -> int:
    h &= MASK32
    for shift, factor in ((16, FMIX_M1), (13, FMIX_M2)):
        h = ((h ^ (h >> shift)) * factor) & MASK32
    return h ^ (h >> 16)


def dropout_base_key(seed: int, step: int, salt: int = 0) -> int:
    """The (seed, salt, step) key: each 32-bit half ``k`` mixed as ``fmix32(h ^ fmix32(k + G))``."""
    h = 0
    for v in (seed, salt, step):
        v = int(v) & 0xFFFFFFFFFFFFFFFF
        for k in (v & MASK32, v >> 32):
            h = fmix32_host(h ^ fmix32_host((k + GOLDEN) & MASK32))
    return h


def mask_rows(shape: tuple[int, ...], sample_ids: Array) -> tuple[int, int]:
    """(N, values per sample) of a dropout mask: one sample id per row."""
    n = shape[0]
    if sample_ids.shape[0] != n:
        raise ValueError(f"{sample_ids.shape[0]} sample ids for a batch of {n}")
    return n, math.prod(shape[1:])


def dropout_threshold(p: float) -> int:
    """Keep an element when its uint32 hash is ``>= threshold``: probability ~ 1 - p."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    return min(int(p * 4294967296.0), MASK32)


def conv_out_hw(
    x_shape: tuple[int, ...], kh: int, kw: int, stride: int, padding: int, out_hw: OutHW = None
) -> tuple[int, int]:
    """The (OH, OW) a kernel computes: all that fit, or the first ``out_hw`` of them."""
    h, w = x_shape[-2:]
    oh, ow = (h + 2 * padding - kh) // stride + 1, (w + 2 * padding - kw) // stride + 1
    if out_hw is None:
        return oh, ow
    if not (0 < out_hw[0] <= oh and 0 < out_hw[1] <= ow):
        raise ValueError(f"out_hw {tuple(out_hw)} outside the {oh}x{ow} outputs of {x_shape}")
    return int(out_hw[0]), int(out_hw[1])


def window(start: int, count: int, stride: int) -> slice:
    return slice(start, start + stride * (count - 1) + 1, stride)
