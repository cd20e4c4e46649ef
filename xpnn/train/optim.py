"""Optimizers over the model's flat buffers (state in the same layout), and schedules."""

import itertools
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from xpnn.backends.common import dtype_is
from xpnn.errors import UserError
from xpnn.nn.layer import is_int
from xpnn.record.phases import UPDATE
from xpnn.record.timeline import union

Array = Any


class OptimArgError(UserError, ValueError):
    """A bad optimizer or schedule argument: ``UserError`` for the CLI, ``ValueError`` for code."""


def _real(value: Any, said: str, positive: bool = False, below: float = math.inf) -> float:
    """``value`` as a float: a real number from 0 (above it if ``positive``) to below ``below``."""
    real = isinstance(value, numbers.Real)
    if not (real and (value > 0 if positive else value >= 0) and value < below):
        raise OptimArgError(f"{said}, got {value!r}")
    return float(value)


SCHEDULES = ("constant", "step", "cosine")


@dataclass
class Schedule:
    """Learning rate at step t: linear warmup (Goyal et al. 2017), then constant, step or cosine."""

    base_lr: float
    kind: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 0
    step_size: int = 1
    gamma: float = 0.1
    min_lr: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            why = f"`schedule`: unknown schedule {self.kind!r} (choose {', '.join(SCHEDULES)})"
            raise OptimArgError(why)
        for name in ("warmup_steps", "total_steps", "step_size"):
            if not is_int(value := getattr(self, name)):
                raise OptimArgError(f"Schedule: {name} must be an int, got {value!r}")
        if self.warmup_steps < 0 or self.total_steps < 0:
            got = f"{self.warmup_steps} and {self.total_steps}"
            raise OptimArgError(f"Schedule: warmup_steps and total_steps must be >= 0, got {got}")
        if self.step_size < 1:
            raise OptimArgError(f"Schedule: step_size must be >= 1, got {self.step_size}")
        _real(self.gamma, "Schedule: gamma must be positive", positive=True)
        if not (0.0 <= self.min_lr <= self.base_lr):  # also refuses nan
            why = f"`min_lr`: must be from 0 to `lr` ({self.base_lr:g}), got {self.min_lr!r}"
            raise OptimArgError(why)
        if self.kind == "cosine" and self.total_steps < 1:
            why = f"Schedule: the cosine schedule needs total_steps >= 1, got {self.total_steps}"
            raise OptimArgError(why)

    def __call__(self, step: int) -> float:
        """Learning rate for the 0-based optimizer step ``step``."""
        if step < self.warmup_steps:
            return self.base_lr * (step + 1) / self.warmup_steps
        t = step - self.warmup_steps
        if self.kind == "step":
            return self.base_lr * self.gamma ** (t // self.step_size)
        if self.kind == "cosine":
            span = max(1, self.total_steps - self.warmup_steps)
            cosine = 0.5 * (1 + math.cos(math.pi * min(t, span) / span))
            return self.min_lr + (self.base_lr - self.min_lr) * cosine
        return self.base_lr


Ranges = list[tuple[int, int]]  # [start, end) ranges of the flat buffer


@dataclass
class GradClip:
    """Clipping by the global norm, by ``clip_grad_norm_``'s formula."""

    max_norm: float
    total: Callable[[float], float] = float  # this rank's sum of squares to the whole model's
    skip: Ranges = field(default_factory=list)  # the ranges another rank counts

    def __post_init__(self) -> None:
        _real(self.max_norm, "`clip_norm`: must be positive", positive=True)


def pieces(part: slice, n: int, ranges: Ranges) -> list[tuple[slice, bool]]:
    """``part`` of ``n`` values cut at ``ranges``: (slice within the part, whether inside one)."""
    start, stop, _ = part.indices(n)
    out, pos = [], start
    for lo, hi in union(ranges):  # the touching ones joined: one kernel call for neighbours
        lo, hi = max(lo, start), min(hi, stop)
        if lo >= hi:
            continue
        if lo > pos:
            out.append((slice(pos - start, lo - start), False))
        out.append((slice(lo - start, hi - start), True))
        pos = hi
    if pos < stop:
        out.append((slice(pos - start, stop - start), False))
    return out


def matrix_ranges(shapes: list[tuple[int, ...]]) -> Ranges:
    """The flat ranges of the matrices among ``shapes``: weight decay spares biases and gains."""
    ends = itertools.accumulate(math.prod(shape) for shape in shapes)
    return [(end - math.prod(s), end) for s, end in zip(shapes, ends, strict=True) if len(s) >= 2]


Hook = Callable[["Optimizer"], None]
SkipRule = Callable[["Optimizer"], bool]


class Optimizer:
    """``start_step``, ``update_part`` per part, ``end_step``; a tuple of grads summed; hooks."""

    state_names: tuple[str, ...] = ()
    hyper_parameters: tuple[str, ...] = ()  # the settings it takes (``make_optimizer``'s keywords)
    scalar_names: tuple[str, ...] = ("lr",)  # what ``step_scalars`` gives the kernels
    device_scalars: dict[str, Array] | None = None  # the kernels' numbers in a replayed step

    @classmethod
    def keywords(cls, hyper: dict[str, Any], matrices: Ranges | None) -> dict[str, Any]:
        return hyper

    def __init__(
        self,
        params: Array,
        grads: Array | tuple[Array, ...],
        kernels: Any,
        schedule: Schedule,
        parts: list[slice] | None = None,
        zeros: Callable[[tuple[int, ...], Any], Array] | None = None,
        clip: GradClip | None = None,
    ) -> None:
        rows = grads if isinstance(grads, tuple) else (grads,)
        if getattr(params, "dtype", None) is None or not dtype_is(params.dtype, "real floating"):
            got = getattr(params, "dtype", type(params).__name__)
            raise OptimArgError(f"optimizer: params must be a floating-point array, got {got}")
        for g in rows:
            if (shape := getattr(g, "shape", None)) != params.shape:
                why = f"grads of shape {shape} do not match params of shape {params.shape}"
                raise OptimArgError(f"optimizer: {why}")
            if not dtype_is(g.dtype, "real floating"):
                raise OptimArgError(f"optimizer: grads must be floating point, got {g.dtype}")
        self.params, self.grads, self.kernels, self.schedule = params, grads, kernels, schedule
        self.step_count = 0
        self.lr = float("nan")
        self.grad_norm = float("nan")  # the last step's, when clipping
        self._scale: float | None = None  # the last step's clipping factor, if below 1
        zeros = zeros or (lambda shape, dtype: kernels.xp.zeros(shape, dtype=dtype))
        self.state = {name: zeros(params.shape, params.dtype) for name in self.state_names}
        self.parts = [slice(None)] if parts is None else list(parts)
        self.clip, n, skip = clip, params.shape[0], clip.skip if clip else []
        self._counted = [[s for s, out in pieces(part, n, skip) if not out] for part in self.parts]

        def views(part: slice) -> tuple[Array, Any, dict[str, Array]]:
            g = tuple(row[part] for row in rows) if len(rows) > 1 else rows[0][part]
            return params[part], g, {name: buf[part] for name, buf in self.state.items()}

        self._views = [views(part) for part in self.parts]
        longest = max((p.shape[0] for p, _, _ in self._views), default=0)
        self._summed = kernels.xp.empty((longest,), dtype=params.dtype) if len(rows) > 1 else None
        self._skip_rules: list[SkipRule] = []
        self._pre_hooks: list[Hook] = []
        self._post_hooks: list[Hook] = []
        self.skipping = False  # whether a skip rule skipped the step under way

    def add_skip_rule(self, rule: SkipRule) -> None:
        """Every rule hears every step (it may agree with other ranks); any True skips it."""
        self._skip_rules.append(rule)

    def add_pre_step_hook(self, hook: Hook) -> None:
        """``hook(optimizer)`` as an applied step starts (gradients final, count not advanced)."""
        self._pre_hooks.append(hook)

    def add_post_step_hook(self, hook: Hook) -> None:
        """``hook(optimizer)`` at ``end_step`` of an applied step (the parameters updated)."""
        self._post_hooks.append(hook)

    def start_step(self) -> float:
        """The next step's learning rate (a recorded step's recorder has done ``advance``)."""
        self.skipping = any([rule(self) for rule in self._skip_rules])  # a list: every rule
        if self.skipping:
            return self.lr
        for hook in self._pre_hooks:
            hook(self)
        if self.device_scalars is None:
            self.advance()
        if self.clip is not None:
            self._clip(self.clip)
        return self.lr

    def end_step(self) -> None:
        if not self.skipping:
            for hook in self._post_hooks:
                hook(self)

    def advance(self) -> float:
        """``start_step``'s host bookkeeping alone: the step count and its learning rate."""
        self.lr = self.schedule(self.step_count)
        self.step_count += 1
        return self.lr

    def _summed_rows(self, p: Array, g: Array | tuple[Array, ...]) -> Array:
        return self.kernels.sum_rows(g, self._summed[: p.shape[0]]) if isinstance(g, tuple) else g

    def _clip(self, clip: GradClip) -> None:
        """``_scale``: the factor to ``max_norm`` (None: within; a device value when recorded)."""
        local: Any = 0.0
        for index, (p, g, _) in enumerate(self._views):
            g = self._summed_rows(p, g)
            for s in self._counted[index]:
                local = local + self.kernels.sum_squares(g[s])
        xp, eager = self.kernels.xp, self.device_scalars is None
        self.grad_norm = math.sqrt(clip.total(float(local))) if eager else xp.sqrt(local)
        factor = clip.max_norm / (self.grad_norm + 1e-6)  # PyTorch's guard against 0
        if eager:  # a nan norm makes the step nan
            self._scale = factor if not factor >= 1.0 else None
        else:  # cast as the eager Python float is
            self._scale = xp.astype(xp.where(factor >= 1.0, 1.0, factor), self.params.dtype)

    def step_scalars(self) -> dict[str, float]:
        return {"lr": self.lr}

    def _scalar(self, name: str, number: Any) -> Any:
        return number if self.device_scalars is None else self.device_scalars[name]

    def update_part(self, index: int) -> None:
        if self.skipping:
            return
        p, g, state = self._views[index]
        with UPDATE:
            g = self._summed_rows(p, g)
            if self._scale is not None:
                g *= self._scale  # the reduced gradients are this step's alone: scaled in place
            self._apply(index, p, g, state)

    def _apply(self, index: int, p: Array, g: Array, state: dict[str, Array]) -> None:
        self.update(p, g, state, self.lr)  # each optimizer's own

    def step(self) -> float:
        lr = self.start_step()
        for index in range(len(self.parts)):
            self.update_part(index)
        self.end_step()
        return lr


class SGD(Optimizer):
    def update(self, p: Array, g: Array, state: dict[str, Array], lr: float) -> None:
        self.kernels.sgd_update(p, g, self._scalar("lr", lr))


class Momentum(Optimizer):
    state_names = ("velocity",)
    hyper_parameters = ("momentum",)

    @classmethod
    def keywords(cls, hyper: dict[str, Any], matrices: Ranges | None) -> dict[str, Any]:
        return {"mu": hyper["momentum"]} if "momentum" in hyper else {}

    def __init__(self, *args: Any, mu: float = 0.9) -> None:
        self.mu = _real(mu, "Momentum: mu must be in [0, 1)", below=1.0)
        super().__init__(*args)

    def update(self, p: Array, g: Array, state: dict[str, Array], lr: float) -> None:
        lr = self._scalar("lr", lr)
        self.kernels.momentum_update(p, g, state["velocity"], lr, self.mu)


class Adam(Optimizer):
    state_names = ("m", "v")
    scalar_names = ("lr_c1", "c2")
    hyper_parameters = ("betas", "eps")

    @classmethod
    def keywords(cls, hyper: dict[str, Any], matrices: Ranges | None) -> dict[str, Any]:
        out = {k: v for k, v in hyper.items() if k != "betas"}  # eps (AdamW's weight_decay)
        if "betas" in hyper:
            if len(hyper["betas"]) != 2:
                raise OptimArgError(f"`betas`: expected two rates, got {hyper['betas']!r}")
            out["beta1"], out["beta2"] = hyper["betas"]
        return out

    def __init__(
        self, *args: Any, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8
    ) -> None:
        self.beta1 = _real(beta1, "Adam: beta1 must be in [0, 1)", below=1.0)
        self.beta2 = _real(beta2, "Adam: beta2 must be in [0, 1)", below=1.0)
        self.eps = _real(eps, "Adam: eps must be positive", positive=True)
        super().__init__(*args)

    def update(
        self, p: Array, g: Array, state: dict[str, Array], lr: float, decay: float = 1.0
    ) -> None:
        m, v, t = state["m"], state["v"], self.step_count
        if self.device_scalars is None:
            self.kernels.adam_update(p, g, m, v, lr, self.beta1, self.beta2, self.eps, t, decay)
            return
        lr_c1, c2 = self.device_scalars["lr_c1"], self.device_scalars["c2"]
        self.kernels.adam_step(p, g, m, v, lr_c1, self.beta1, self.beta2, self.eps, c2, decay)

    def step_scalars(self) -> dict[str, float]:
        """Adam's bias corrections folded as ``adam_update`` folds them."""
        t = self.step_count
        return {"lr_c1": self.lr / (1 - self.beta1**t), "c2": 1 - self.beta2**t}


class AdamW(Adam):
    """Adam with decoupled weight decay (``torch.optim.AdamW``) of ``matrices`` (default all)."""

    scalar_names = ("lr_c1", "c2", "decay")
    hyper_parameters = (*Adam.hyper_parameters, "weight_decay")

    @classmethod
    def keywords(cls, hyper: dict[str, Any], matrices: Ranges | None) -> dict[str, Any]:
        return super().keywords(hyper, matrices) | {"matrices": matrices}

    def __init__(
        self, *args: Any, weight_decay: float = 0.01, matrices: Ranges | None = None, **adam: Any
    ) -> None:
        self.weight_decay = _real(weight_decay, "`weight_decay`: must be >= 0")
        super().__init__(*args, **adam)
        n = self.params.shape[0]
        ranges = [(0, n)] if matrices is None else matrices
        self._decayed = [pieces(part, n, ranges) for part in self.parts]

    def step_scalars(self) -> dict[str, float]:
        return super().step_scalars() | {"decay": 1.0 - self.lr * self.weight_decay}

    def _apply(self, index: int, p: Array, g: Array, state: dict[str, Array]) -> None:
        decay = self._scalar("decay", 1.0 - self.lr * self.weight_decay)
        for s, decays in self._decayed[index]:
            views = {name: buf[s] for name, buf in state.items()}
            self.update(p[s], g[s], views, self.lr, decay if decays else 1.0)


OPTIMIZERS = {"sgd": SGD, "momentum": Momentum, "adam": Adam, "adamw": AdamW}
HYPER_PARAMETERS = {name: cls.hyper_parameters for name, cls in OPTIMIZERS.items()}
HYPERS = tuple(dict.fromkeys(h for taken in HYPER_PARAMETERS.values() for h in taken))


def make_optimizer(
    name: str,
    params: Array,
    grads: Array | tuple[Array, ...],
    kernels: Any,
    schedule: Schedule,
    parts: list[slice] | None = None,
    zeros: Callable[[tuple[int, ...], Any], Array] | None = None,
    *,
    matrices: Ranges | None = None,
    clip: GradClip | None = None,
    **hyper: Any,
) -> Optimizer:
    """Optimizer ``name``; ``hyper`` by the settings' names, None keeping the default."""
    if name not in OPTIMIZERS:
        raise UserError(f"`optimizer`: unknown optimizer {name!r} (choose {', '.join(OPTIMIZERS)})")
    kind = OPTIMIZERS[name]
    given = {key: value for key, value in hyper.items() if value is not None}
    if unknown := [key for key in given if key not in kind.hyper_parameters]:
        raise OptimArgError(f"`{unknown[0]}`: not a hyper-parameter of `optimizer` {name}")
    args = (params, grads, kernels, schedule, parts, zeros, clip)
    return kind(*args, **kind.keywords(given, matrices))
