"""The Layer contract: build once, then forward and backward side by side.

A layer declares its parameters at ``build`` time with host-side initial values; the model then
places every parameter and gradient as a view into one flat buffer (what the communicator
sends whole). ``forward`` keeps what ``backward`` needs; ``backward`` *assigns* (never adds)
the layer's gradients and returns the gradient of its input.
"""

from __future__ import annotations

import copy
import numbers
from dataclasses import dataclass
from typing import Any

Array = Any


def is_int(value: Any) -> bool:
    """An int or a NumPy integer: a count or a size. Not a bool (``True`` is an int to
    Python, never a count), a float or a string."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(owner: str, name: str, value: Any, minimum: int = 1) -> int:
    """``value`` as a Python int (``is_int``) that is at least ``minimum``; else a one-line
    TypeError/ValueError naming ``owner`` and ``name``."""
    if not is_int(value):
        raise TypeError(f"{owner}: {name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{owner}: {name} must be >= {minimum}, got {value!r}")
    return int(value)


@dataclass
class Context:
    """What a forward pass needs beyond the input: mode, and what keys dropout's randomness.

    ``sample_ids`` are the samples' indices in the data set and ``step`` the global step, so a
    sample's dropout mask does not depend on which rank or batch position it landed on. With
    ``step=None`` (a hand-written loop) each Dropout layer counts its own training passes, so
    every step still draws new masks; the trainer gives the step, which makes a resumed run
    draw what the uninterrupted one did.
    """

    train: bool = False
    step: int | None = None
    seed: int = 0
    sample_ids: Array | None = None


class Layer:
    """Base class: parameters, gradients and the backend they live on."""

    def __init__(self) -> None:
        self.params: dict[str, Array] = {}
        self.grads: dict[str, Array] = {}
        self.initial: dict[str, tuple[Any, tuple[int, ...]]] = {}

    def build(self, in_shape: tuple[int, ...], backend: Any, rng: Any) -> tuple[int, ...]:
        """Bind to a backend, declare parameters (host arrays from ``rng``), return out shape."""
        self.backend = backend
        self.xp = backend.xp
        self.kernels = backend.kernels
        return self.setup(tuple(in_shape), rng)

    def setup(self, in_shape: tuple[int, ...], rng: Any) -> tuple[int, ...]:
        """Override: declare parameters with ``add_param`` and return the output shape."""
        return in_shape

    def add_param(self, name: str, initial: Any, shape: tuple[int, ...] | None = None) -> None:
        """Declare a parameter: a host array, or a constant (e.g. 0.0) with its ``shape``."""
        self.initial[name] = (initial, tuple(shape if shape is not None else initial.shape))

    def forward(self, x: Array, ctx: Context) -> Array:
        raise NotImplementedError

    def replica(self) -> Layer:
        """A twin sharing this layer's parameters and gradients (the same views) with its own
        forward state: a pipeline stage keeps one per micro-batch in flight. A layer that
        reuses scratch buffers across calls gives its twin its own."""
        return copy.copy(self)

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return type(self).__name__ + "()"
