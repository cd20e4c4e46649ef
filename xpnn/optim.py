"""Optimizers over the model's flat buffers (state in the same layout), and schedules."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from xpnn.backends.common import dtype_is
from xpnn.errors import UserError
from xpnn.nn.layer import is_int
from xpnn.phases import UPDATE

Array = Any


class OptimArgError(UserError, ValueError):
    """A bad optimizer or schedule argument: ``UserError`` for the CLI, ``ValueError`` for code."""


SCHEDULES = ("constant", "step", "cosine")


@dataclass
class Schedule:
    """Learning rate at step t: linear warmup from ~0 (Goyal et al., 2017: large batches start
    gently), then constant, ``gamma`` every ``step_size`` steps, or cosine to ``total_steps``."""

    base_lr: float
    kind: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 0
    step_size: int = 1
    gamma: float = 0.1

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise OptimArgError(
                f"`schedule`: unknown schedule {self.kind!r} (choose {', '.join(SCHEDULES)})"
            )
        if not self.base_lr > 0 or not math.isfinite(self.base_lr):
            raise OptimArgError(f"`lr`: must be positive, got {self.base_lr}")
        for name in ("warmup_steps", "total_steps", "step_size"):
            value = getattr(self, name)
            if not is_int(value):
                raise OptimArgError(f"Schedule: {name} must be an int, got {value!r}")
        if self.warmup_steps < 0 or self.total_steps < 0:
            raise OptimArgError(
                f"Schedule: warmup_steps and total_steps must be >= 0, got "
                f"{self.warmup_steps} and {self.total_steps}"
            )
        if self.step_size < 1:
            raise OptimArgError(f"Schedule: step_size must be >= 1, got {self.step_size}")
        if not self.gamma > 0 or not math.isfinite(self.gamma):
            raise OptimArgError(f"Schedule: gamma must be positive, got {self.gamma}")
        if self.kind == "cosine" and self.total_steps < 1:
            raise OptimArgError(
                f"Schedule: the cosine schedule needs total_steps >= 1, got {self.total_steps}"
            )

    def __call__(self, step: int) -> float:
        """Learning rate for the 0-based optimizer step ``step``."""
        if step < self.warmup_steps:
            return self.base_lr * (step + 1) / self.warmup_steps
        t = step - self.warmup_steps
        if self.kind == "step":
            return self.base_lr * self.gamma ** (t // self.step_size)
        if self.kind == "cosine":
            span = max(1, self.total_steps - self.warmup_steps)
            return 0.5 * self.base_lr * (1 + math.cos(math.pi * min(t, span) / span))
        return self.base_lr


class Optimizer:
    """``grads``: a flat buffer, or a tuple of them to sum (ranks sharing the parameters);
    ``parts``: the slices ``update_part`` updates; ``zeros``: allocates the whole state."""

    state_names: tuple[str, ...] = ()

    def __init__(
        self,
        params: Array,
        grads: Array | tuple[Array, ...],
        kernels: Any,
        schedule: Schedule,
        parts: list[slice] | None = None,
        zeros: Callable[[tuple[int, ...], Any], Array] | None = None,
    ) -> None:
        rows = grads if isinstance(grads, tuple) else (grads,)
        _check_buffers(params, rows)
        self.params, self.grads, self.kernels, self.schedule = params, grads, kernels, schedule
        self.step_count = 0
        self.lr = float("nan")
        zeros = zeros or (lambda shape, dtype: kernels.xp.zeros(shape, dtype=dtype))
        self.state = {name: zeros(params.shape, params.dtype) for name in self.state_names}
        self.parts = [slice(None)] if parts is None else list(parts)
        self._views = [
            (
                params[part],
                tuple(g[part] for g in rows) if len(rows) > 1 else rows[0][part],
                {name: buf[part] for name, buf in self.state.items()},
            )
            for part in self.parts
        ]
        longest = max((p.shape[0] for p, _, _ in self._views), default=0)
        self._summed = kernels.xp.empty((longest,), dtype=params.dtype) if len(rows) > 1 else None

    def start_step(self) -> float:
        """Advance to the next step and return its learning rate; before any ``update_part``."""
        self.lr = self.schedule(self.step_count)
        self.step_count += 1
        return self.lr

    def update_part(self, index: int) -> None:
        """Update ``parts[index]`` with the current gradients at this step's learning rate."""
        p, g, state = self._views[index]
        with UPDATE:
            if isinstance(g, tuple):
                g = self.kernels.sum_rows(g, self._summed[: p.shape[0]])
            self.update(p, g, state, self.lr)

    def step(self) -> float:
        """Apply one update to every part; returns the learning rate used."""
        lr = self.start_step()
        for index in range(len(self.parts)):
            self.update_part(index)
        return lr

    def update(self, p: Array, g: Array, state: dict[str, Array], lr: float) -> None:
        raise NotImplementedError


def _check_buffers(params: Array, rows: tuple[Array, ...]) -> None:
    """The kernels index every buffer by the parameters' layout: same shape, floating point."""
    if getattr(params, "dtype", None) is None or not dtype_is(params.dtype, "real floating"):
        raise OptimArgError(
            f"optimizer: params must be a floating-point array, got "
            f"{getattr(params, 'dtype', type(params).__name__)}"
        )
    for g in rows:
        if getattr(g, "shape", None) != params.shape:
            raise OptimArgError(
                f"optimizer: grads of shape {getattr(g, 'shape', None)} do not match params "
                f"of shape {params.shape}"
            )
        if not dtype_is(g.dtype, "real floating"):
            raise OptimArgError(f"optimizer: grads must be floating point, got {g.dtype}")


def _check_rate(owner: str, name: str, value: float) -> float:
    """A decay rate: a real number in [0, 1)."""
    if not (isinstance(value, numbers.Real) and 0.0 <= value < 1.0):
        raise OptimArgError(f"{owner}: {name} must be in [0, 1), got {value!r}")
    return float(value)


class SGD(Optimizer):
    """Plain (mini-batch, or with the whole data set as one batch, full) gradient descent."""

    def update(self, p: Array, g: Array, state: dict[str, Array], lr: float) -> None:
        self.kernels.sgd_update(p, g, lr)


class Momentum(Optimizer):
    state_names = ("velocity",)

    def __init__(self, *args: Any, mu: float = 0.9) -> None:
        self.mu = _check_rate("Momentum", "mu", mu)
        super().__init__(*args)

    def update(self, p: Array, g: Array, state: dict[str, Array], lr: float) -> None:
        self.kernels.momentum_update(p, g, state["velocity"], lr, self.mu)


class Adam(Optimizer):
    state_names = ("m", "v")

    def __init__(
        self, *args: Any, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8
    ) -> None:
        self.beta1 = _check_rate("Adam", "beta1", beta1)
        self.beta2 = _check_rate("Adam", "beta2", beta2)
        if not (isinstance(eps, numbers.Real) and 0.0 < eps < math.inf):
            raise OptimArgError(f"Adam: eps must be positive, got {eps!r}")
        self.eps = float(eps)
        super().__init__(*args)

    def update(self, p: Array, g: Array, state: dict[str, Array], lr: float) -> None:
        self.kernels.adam_update(
            p, g, state["m"], state["v"], lr, self.beta1, self.beta2, self.eps, self.step_count
        )


def make_optimizer(
    name: str,
    params: Array,
    grads: Array | tuple[Array, ...],
    kernels: Any,
    schedule: Schedule,
    parts: list[slice] | None = None,
    zeros: Callable[[tuple[int, ...], Any], Array] | None = None,
) -> Optimizer:
    classes = {"sgd": SGD, "momentum": Momentum, "adam": Adam}
    if name not in classes:
        raise UserError(f"`optimizer`: unknown optimizer {name!r} (choose {', '.join(classes)})")
    return classes[name](params, grads, kernels, schedule, parts, zeros)
