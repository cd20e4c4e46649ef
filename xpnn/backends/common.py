"""What every backend shares: dtype kinds, convolution geometry, the dropout hash, StepScalars."""

import math
from collections.abc import Callable
from typing import Any

import numpy as np

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


def taps(kh: int, kw: int, oh: int, ow: int, stride: int) -> list[tuple[slice, slice]]:
    """Each kernel tap's (rows, columns) of the (padded) input, the taps in (i, j) order."""
    rows = [slice(i, i + stride * (oh - 1) + 1, stride) for i in range(kh)]
    cols = [slice(j, j + stride * (ow - 1) + 1, stride) for j in range(kw)]
    return [(r, q) for r in rows for q in cols]


class CaptureFailed(RuntimeError):
    """The work could not be recorded (it waited for the device, say); nothing of it ran."""


class StepScalars:
    """Device buffers, one per dtype, ``refresh``ed before each step; kernels read 0-d views."""

    CAPACITY = 64  # values of one dtype: an optimizer takes 3, each Dropout layer 1

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._buffers: dict[str, tuple[Array, np.ndarray]] = {}  # dtype -> (device, host)
        self._values: list[tuple[str, int, Callable[[int], float]]] = []
        self._step: int | None = None  # the last ``refresh``'s
        self._keys: dict[tuple[int, int], Array] = {}
        self.step = self  # ``Context.step`` of a replayed step: dropout's keys read from here

    def add(self, dtype: Any, compute: Callable[[int], float]) -> Array:
        """A 0-d device array holding ``compute(step)`` from each ``refresh(step)`` on."""
        name = np.dtype(dtype).name
        if name not in self._buffers:
            device = self.backend.xp.zeros((self.CAPACITY,), dtype=dtype)
            self._buffers[name] = (device, np.zeros(self.CAPACITY, dtype=name))
        index = sum(1 for kind, _, _ in self._values if kind == name)
        if index >= self.CAPACITY:
            raise ValueError(f"StepScalars: more than {self.CAPACITY} {name} values")
        self._values.append((name, index, compute))
        if self._step is not None:  # asked for during a step: this step's value too
            self.refresh(self._step)
        return self._buffers[name][0][index : index + 1].reshape(())  # NumPy's [index]: a copy

    def refresh(self, step: int) -> None:
        self._step = step
        for name, index, compute in self._values:
            self._buffers[name][1][index] = compute(step)
        for device, host in self._buffers.values():
            device[...] = self.backend.asarray(host, dtype=device.dtype)

    def dropout_key(self, seed: int, salt: int) -> Array:
        """A 0-d uint32 device array: ``dropout_base_key(seed, step, salt)`` of each step."""
        if (seed, salt) not in self._keys:
            self._keys[seed, salt] = self.add(np.uint32, lambda s: dropout_base_key(seed, s, salt))
        return self._keys[seed, salt]


def step_key(seed: int, step: Any, salt: int) -> Any:
    """Dropout's base key of ``step``: a number, or a device value for a replayed step's."""
    if isinstance(step, StepScalars):
        return step.dropout_key(seed, salt)
    return dropout_base_key(seed, step, salt)


def host_or_device(dtype: Any, value: Any) -> Any:
    """A kernel's scalar in ``dtype``: numbers (NumPy's too) converted, device values unread."""
    return dtype.type(value) if isinstance(value, int | float | np.generic) else value
