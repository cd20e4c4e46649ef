"""Optimizers over the model's flat buffers, and learning-rate schedules with warmup.

An optimizer updates the whole flat parameter vector in one kernel call per step (the same
kernel on every backend, fused where the backend can), and its state lives in flat buffers of
the same layout, which makes checkpoints and the state's equality across ranks trivial.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from xpnn.errors import UserError

Array = Any
OPTIMIZERS = ("sgd", "momentum", "adam")
SCHEDULES = ("constant", "step", "cosine")


@dataclass
class Schedule:
    """Learning rate at step t: linear warmup from ~0, then constant, step decay or cosine.

    Warmup follows Goyal et al. (2017): large effective batches (many ranks, linearly scaled
    learning rates) start gently. ``total_steps`` is needed by the cosine schedule only.
    """

    base_lr: float
    kind: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 0
    step_size: int = 1
    gamma: float = 0.1

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise UserError(f"--schedule: unknown schedule {self.kind!r} (choose {SCHEDULES})")
        if not self.base_lr > 0:
            raise UserError(f"--lr: must be positive, got {self.base_lr}")

    def __call__(self, step: int) -> float:
        """Learning rate for the 0-based optimizer step ``step``."""
        if step < self.warmup_steps:
            return self.base_lr * (step + 1) / self.warmup_steps
        t = step - self.warmup_steps
        if self.kind == "step":
            return self.base_lr * self.gamma ** (t // max(1, self.step_size))
        if self.kind == "cosine":
            span = max(1, self.total_steps - self.warmup_steps)
            return 0.5 * self.base_lr * (1 + math.cos(math.pi * min(t, span) / span))
        return self.base_lr


class Optimizer:
    """Base: holds the flat parameters/gradients, a schedule and named flat state buffers.

    ``shard`` (a slice of the flat buffers) makes this rank update only that part, as ranks do
    when they share one copy of the parameters (``parallel.shared_update``); ``zeros(shape,
    dtype)`` allocates the state buffers, which always cover the whole model so that a
    checkpoint reads them whole. ``p``, ``g`` and ``s`` are the views the update works on.
    """

    state_names: tuple[str, ...] = ()

    def __init__(
        self,
        params: Array,
        grads: Array,
        kernels: Any,
        schedule: Schedule,
        shard: slice | None = None,
        zeros: Callable[[tuple[int, ...], Any], Array] | None = None,
    ) -> None:
        self.params, self.grads, self.kernels, self.schedule = params, grads, kernels, schedule
        self.step_count = 0
        zeros = zeros or (lambda shape, dtype: kernels.xp.zeros(shape, dtype=dtype))
        self.state = {name: zeros(params.shape, params.dtype) for name in self.state_names}
        self.shard = shard or slice(None)
        self.p, self.g = params[self.shard], grads[self.shard]
        self.s = {name: buf[self.shard] for name, buf in self.state.items()}

    def step(self) -> float:
        """Apply one update with the current gradients; returns the learning rate used."""
        lr = self.schedule(self.step_count)
        self.step_count += 1
        self.update(lr)
        return lr

    def update(self, lr: float) -> None:
        raise NotImplementedError


class SGD(Optimizer):
    """Plain (mini-batch, or with the whole data set as one batch, full) gradient descent."""

    def update(self, lr: float) -> None:
        self.kernels.sgd_update(self.p, self.g, lr)


class Momentum(Optimizer):
    state_names = ("velocity",)

    def __init__(self, *args: Any, mu: float = 0.9) -> None:
        super().__init__(*args)
        self.mu = mu

    def update(self, lr: float) -> None:
        self.kernels.momentum_update(self.p, self.g, self.s["velocity"], lr, self.mu)


class Adam(Optimizer):
    state_names = ("m", "v")

    def __init__(
        self, *args: Any, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8
    ) -> None:
        super().__init__(*args)
        self.beta1, self.beta2, self.eps = beta1, beta2, eps

    def update(self, lr: float) -> None:
        m, v = self.s["m"], self.s["v"]
        self.kernels.adam_update(
            self.p, self.g, m, v, lr, self.beta1, self.beta2, self.eps, self.step_count
        )


def make_optimizer(
    name: str,
    params: Array,
    grads: Array,
    kernels: Any,
    schedule: Schedule,
    shard: slice | None = None,
    zeros: Callable[[tuple[int, ...], Any], Array] | None = None,
) -> Optimizer:
    classes = {"sgd": SGD, "momentum": Momentum, "adam": Adam}
    if name not in classes:
        raise UserError(f"--optimizer: unknown optimizer {name!r} (choose {', '.join(classes)})")
    return classes[name](params, grads, kernels, schedule, shard, zeros)
