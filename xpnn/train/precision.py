"""Mixed precision: fp32 master parameters and optimizer state stay in the flat buffers the
update owns; forward and backward run on a low-precision flat copy (bf16 or fp16), re-cast after
each update; the low-precision gradients are cast to fp32 (and unscaled) as backward finishes
them, before the exchange. fp16 adds dynamic loss scaling (PyTorch's ``GradScaler`` rule)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from xpnn.errors import UserError
from xpnn.parallel.comm.narrow import native_dtype, quiet_overflows

Array = Any
PRECISIONS = ("fp32", "bf16", "fp16")
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16"}
INITIAL_SCALE = 2.0**15  # PyTorch GradScaler's init_scale is 2**16; 2**15 leaves fp16 headroom
GROWTH_INTERVAL = 2000  # good steps before the scale doubles (GradScaler's default)


def low_dtype(xp: Any, precision: str) -> Any:
    """The array library's dtype for ``precision``: its own, else ``ml_dtypes``' (NumPy has
    float16 but no bfloat16) where its arrays accept that one."""
    name = DTYPE_NAMES[precision]
    dtype = native_dtype(xp, name)
    if dtype is None:
        raise UserError(f"`precision` {precision}: {xp.__name__} arrays have no {name}")
    return dtype


@dataclass
class LossScale:
    """Dynamic loss scaling: multiply the loss by ``scale``; a step whose gradients overflow is
    skipped and halves it, ``growth_interval`` good steps in a row double it."""

    scale: float = INITIAL_SCALE
    growth_interval: int = GROWTH_INTERVAL
    good_steps: int = 0
    skipped: int = 0

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps, so that a resumed run scales as the uninterrupted one."""
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def restore(self, state: dict[str, Any]) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
        self.skipped = int(state["skipped"])

    def update(self, finite: bool) -> bool:
        """Record a step's verdict; returns whether the step is applied."""
        if not finite:
            self.scale = max(self.scale / 2.0, 1.0)
            self.good_steps = 0
            self.skipped += 1
            return False
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= 2.0
            self.good_steps = 0
        return True


def overflow_skip(
    model: Any, xp: Any, loss_scale: LossScale, agree: Callable[[float], float]
) -> Callable[[Any], bool]:
    """An optimizer's skip rule (``Optimizer.add_skip_rule``): a step whose reduced gradients
    (``model.grads``) hold an infinity or a NaN on any rank (``agree`` sums the counts) is
    skipped, and ``loss_scale`` told of every step's verdict."""

    def skip(_optimizer: Any) -> bool:
        grads = model.grads  # this rank's gradients, reduced where it owns them
        bad = 0.0 if bool(xp.all(xp.isfinite(grads))) else 1.0
        return not loss_scale.update(agree(bad) == 0)

    return skip


@dataclass
class WideLoss:
    """``loss`` in the master precision (softmax in low precision loses the small
    probabilities); its gradient back in ``low`` precision, multiplied by the loss scale: the
    loss object a model computes with while it runs on the low-precision copy."""

    loss: Any
    xp: Any
    wide: Any  # the master dtype
    low: Any
    loss_scale: LossScale | None

    def __call__(self, kernels: Any, logits: Array, labels: Array, scale: float) -> Any:
        factor = self.loss_scale.scale if self.loss_scale else 1.0
        loss, dlogits = self.loss(kernels, self.xp.astype(logits, self.wide), labels, scale)
        if factor != 1.0:
            dlogits *= factor
        return loss, self.xp.astype(dlogits, self.low)


class Precision:
    """The low-precision side of a data-parallel run on ``backend``: ``attach`` a built model
    and its update's optimizer, then train through ``loss_and_grads`` and ``evaluate``."""

    def __init__(
        self,
        precision: str,
        backend: Any,
        loss_scale: LossScale | None = None,
        agree: Callable[[float], float] = float,
    ) -> None:
        """``agree``: a count of bad values on this rank -> the total over the ranks that
        hold parts of the reduced gradient (collective), so that every rank skips together."""
        if precision not in DTYPE_NAMES:
            raise ValueError(f"precision: {precision!r}, choose one of {', '.join(DTYPE_NAMES)}")
        self.name, self.backend, self.xp = precision, backend, backend.xp
        self.dtype = low_dtype(self.xp, precision)
        if loss_scale is None and precision == "fp16":
            loss_scale = LossScale()
        self.loss_scale = loss_scale
        self.agree = agree
        self._dirty = True  # the low-precision parameters lag the master ones

    @property
    def skipped(self) -> int:
        """Steps skipped because their gradients overflowed."""
        return self.loss_scale.skipped if self.loss_scale else 0

    def attach(self, model: Any, optimizer: Any) -> None:
        """Make the low-precision copies of ``model``'s flat buffers; hook ``optimizer``: an
        applied step marks the low copy stale, and with loss scaling a step whose reduced
        gradients are not finite is skipped (no update, no step counted)."""
        self.model = model
        self.master = (model.params, model.grads)
        self.low_params = self.xp.astype(model.params, self.dtype)
        self.low_grads = self.xp.zeros_like(self.low_params)
        self.loss, scale = model.loss, self.loss_scale
        self.wide_loss = WideLoss(model.loss, self.xp, model.params.dtype, self.dtype, scale)
        optimizer.add_post_step_hook(self._stale)
        if self.loss_scale is not None:
            optimizer.add_skip_rule(overflow_skip(model, self.xp, self.loss_scale, self.agree))

    def _stale(self, _optimizer: Any) -> None:
        self._dirty = True

    def _low(self) -> None:
        """Point the layers at the low-precision copy, re-cast from the master if stale."""
        master = self.master[0]
        if self._dirty:
            with warnings.catch_warnings():  # a weight past fp16's range is inf: the loss
                warnings.simplefilter("ignore", RuntimeWarning)  # says so, in one line
                self.low_params[...] = self.xp.astype(master, self.dtype)
            self._dirty = False
        self.model.adopt(self.low_params, self.low_grads, copy=False)
        self.model.loss = self.wide_loss

    def _master(self) -> None:
        self.model.adopt(*self.master, copy=False)
        self.model.loss = self.loss

    def _casting(self, ready: Callable[[int], None] | None) -> Callable[[int], None]:
        """A backward's ``on_grads_ready`` that first casts each newly final low-precision
        ``[offset:]`` into the fp32 gradients (divided by the loss scale), then reports it."""
        xp, low, grads = self.xp, self.low_grads, self.master[1]
        inverse = 1.0 / self.loss_scale.scale if self.loss_scale else 1.0
        done = [grads.shape[0]]

        def casting(offset: int) -> None:
            part = xp.astype(low[offset : done[0]], grads.dtype)
            if inverse != 1.0:
                part *= inverse
            grads[offset : done[0]] = part
            done[0] = offset
            if ready is not None:
                ready(offset)

        return casting

    def _quiet(self) -> Any:
        """Overflow warnings silenced under loss scaling (an fp16 overflow is its to handle)."""
        return quiet_overflows(self.xp) if self.loss_scale else contextlib.nullcontext()

    def loss_and_grads(
        self, x: Array, labels: Array, ctx: Any, scale: float, ready: Callable[[int], None] | None
    ) -> tuple[Array, Array]:
        """The model's ``loss_and_grads`` in low precision; the fp32 gradients come out."""
        self._low()
        try:
            x = None if x is None else self.xp.astype(x, self.dtype)
            casting = self._casting(ready)
            with self._quiet():  # an fp16 overflow is the loss scale's to handle
                loss, correct = self.model.loss_and_grads(x, labels, ctx, scale, casting)
        finally:
            self._master()
        return loss, correct

    def evaluate(self, x: Array, labels: Array) -> tuple[Array, Array]:
        """The model's ``evaluate`` with the low-precision forward and the fp32 loss."""
        self._low()
        try:
            x = None if x is None else self.xp.astype(x, self.dtype)
            with self._quiet():  # the unused gradient of the loss, scaled, may overflow
                return self.model.evaluate(x, labels)
        finally:
            self._master()
