"""A replayed (captured) step's per-step values, in device memory where its graph reads them."""

from collections.abc import Callable
from typing import Any

import numpy as np

from xpnn.backends.common import Array, dropout_base_key


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
