"""Mixed precision: fp32 master copy and state, bf16/fp16 passes, fp16 loss scaling."""

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from xpnn.errors import UserError
from xpnn.parallel.comm.narrow import native_dtype, quiet_overflows

Array = Any
PRECISIONS = ("fp32", "bf16", "fp16")
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16"}


@dataclass
class LossScale:
    """An overflow skips the step and halves ``scale``; ``growth_interval`` good steps double it."""

    scale: float = 2.0**15  # PyTorch GradScaler's init_scale is 2**16; 2**15 leaves headroom
    growth_interval: int = 2000  # good steps before the scale doubles (GradScaler's default)
    good_steps: int = 0
    skipped: int = 0

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps, so that a resumed run scales as the uninterrupted one."""
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def restore(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.good_steps, self.skipped = int(state["good_steps"]), int(state["skipped"])

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
    """A skip rule: a step whose gradients are not finite on some rank (``agree`` sums)."""

    def skip(_optimizer: Any) -> bool:
        grads = model.grads  # this rank's gradients, reduced where it owns them
        bad = 0.0 if bool(xp.all(xp.isfinite(grads))) else 1.0
        return not loss_scale.update(agree(bad) == 0)

    return skip


@dataclass
class WideLoss:
    """``loss`` in the master precision (a low softmax loses small probabilities), scaled."""

    of: "Precision"

    def __call__(self, kernels: Any, logits: Array, labels: Array, scale: float) -> Any:
        p = self.of
        factor = p.loss_scale.scale if p.loss_scale else 1.0
        loss, dlogits = p.loss(kernels, p.xp.astype(logits, p.master[0].dtype), labels, scale)
        if factor != 1.0:
            dlogits *= factor
        return loss, p.xp.astype(dlogits, p.dtype)


class Precision:
    """``model``'s passes on low-precision copies of its buffers; ``loss_scale``: fp16's."""

    def __init__(self, model: Any, optimizer: Any, precision: str, loss_scale: Any) -> None:
        self.xp, self.model, self.master = model.backend.xp, model, (model.params, model.grads)
        name = DTYPE_NAMES[precision]  # the library's own, else ml_dtypes' (NumPy's bfloat16)
        self.dtype = native_dtype(self.xp, name)
        if self.dtype is None:
            raise UserError(f"`precision` {precision}: {self.xp.__name__} arrays have no {name}")
        self.loss_scale = loss_scale
        self._dirty = True  # the low-precision parameters lag the master ones, after each step
        self.low_params = self.xp.astype(model.params, self.dtype)
        self.low_grads = self.xp.zeros_like(self.low_params)
        self.loss, self.wide_loss = model.loss, WideLoss(self)
        optimizer.add_post_step_hook(self._stale)

    def _stale(self, _optimizer: Any) -> None:
        self._dirty = True

    @contextlib.contextmanager
    def _lowered(self, x: Array) -> Iterator[Array]:
        """The layers on the low-precision copy and ``x`` cast; fp16 overflows are the scale's."""
        if self._dirty:
            with warnings.catch_warnings():  # a weight past fp16's range is inf: the loss
                warnings.simplefilter("ignore", RuntimeWarning)  # says so, in one line
                self.low_params[...] = self.xp.astype(self.master[0], self.dtype)
            self._dirty = False
        self.model.adopt(self.low_params, self.low_grads, copy=False)
        self.model.loss = self.wide_loss
        try:
            with quiet_overflows(self.xp) if self.loss_scale else contextlib.nullcontext():
                yield None if x is None else self.xp.astype(x, self.dtype)
        finally:
            self.model.adopt(*self.master, copy=False)
            self.model.loss = self.loss

    def loss_and_grads(
        self, x: Array, labels: Array, ctx: Any, scale: float, ready: Callable[[int], None] | None
    ) -> tuple[Array, Array]:
        """The model's ``loss_and_grads`` in low precision; the fp32 gradients come out."""
        xp, low_grads, grads = self.xp, self.low_grads, self.master[1]
        inverse = 1.0 / self.loss_scale.scale if self.loss_scale else 1.0
        done = [grads.shape[0]]

        def casting(offset: int) -> None:  # each newly final ``[offset:]`` cast, then ``ready``
            part = xp.astype(low_grads[offset : done[0]], grads.dtype)
            if inverse != 1.0:
                part *= inverse
            grads[offset : done[0]] = part
            done[0] = offset
            if ready is not None:
                ready(offset)

        with self._lowered(x) as low:
            return self.model.loss_and_grads(low, labels, ctx, scale, casting)

    def evaluate(self, x: Array, labels: Array) -> tuple[Array, Array]:
        with self._lowered(x) as low:
            return self.model.evaluate(low, labels)
