"""Layers and composites: host-declared parameters, views of one flat buffer; backward assigns."""

import copy
import math
import numbers
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

Array = Any


def is_int(value: Any) -> bool:
    """An int or a NumPy integer, not a bool (to Python an int, never a count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(owner: str, name: str, value: Any, minimum: int = 1) -> int:
    """``value`` as a Python int at least ``minimum``; else a one-line TypeError/ValueError."""
    if not is_int(value):
        raise TypeError(f"{owner}: {name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{owner}: {name} must be >= {minimum}, got {value!r}")
    return int(value)


def he_normal(rng: Any, shape: tuple[int, ...], fan_in: int) -> Any:
    """He et al. (2015), drawn on the host: keeps ReLU activations' variance through depth."""
    return rng.standard_normal(shape) * math.sqrt(2.0 / fan_in)


def for_activation(rng: Any, fan_in: int, fan_out: int, act: str) -> Any:
    """He normal for ReLU; else Glorot & Bengio's (2010) uniform, for symmetric activations."""
    if act == "relu":
        return he_normal(rng, (fan_in, fan_out), fan_in)
    limit = math.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, size=(fan_in, fan_out))


def copy_array(xp: Any, a: Array) -> Array:
    """A copy of ``a`` (NumPy and CuPy arrays have ``copy``; an array API one may not)."""
    return a.copy() if hasattr(a, "copy") else xp.asarray(a, copy=True)


@dataclass
class Context:
    """The mode, and what keys dropout's masks: the global step and the samples' indices."""

    train: bool = False
    step: int | None = None
    seed: int = 0
    sample_ids: Array | None = None


class Layer:
    """Base class: parameters, gradients, their backend, and what models and strategies ask."""

    # tensor parallelism: "none" (refused), "replicate", "elementwise" or "dense" (Megatron)
    tensor_split: ClassVar[str] = "none"
    # Megatron (column, row, column_group, row_group) Dense sublayers, cut in groups (q, k, v)
    tensor_pairs: tuple[tuple[str, str, int, int], ...] = ()
    repr_attrs: ClassVar[tuple[str, ...]] = ()  # what ``repr`` says: ``Dropout(0.5)``

    def __init__(self) -> None:
        self.params: dict[str, Array] = {}
        self.grads: dict[str, Array] = {}
        self.initial: dict[str, tuple[Any, tuple[int, ...]]] = {}

    def build(self, in_shape: tuple[int, ...], backend: Any, rng: Any) -> tuple[int, ...]:
        """Bind to a backend, declare parameters (host arrays from ``rng``), return out shape."""
        self.backend, self.xp, self.kernels = backend, backend.xp, backend.kernels
        return self.setup(tuple(in_shape), rng)

    def setup(self, in_shape: tuple[int, ...], rng: Any) -> tuple[int, ...]:
        """Override: declare parameters with ``add_param`` and return the output shape."""
        return in_shape

    def add_param(self, name: str, initial: Any, shape: tuple[int, ...] | None = None) -> None:
        """Declare a parameter: a host array, or a constant (e.g. 0.0) with its ``shape``."""
        self.initial[name] = (initial, tuple(shape if shape is not None else initial.shape))

    def bind(self, name: str, param: Array, grad: Array) -> None:
        self.params[name] = param
        self.grads[name] = grad

    def walk(self) -> Iterator["Layer"]:
        """This layer and every layer inside it (a composite's sublayers, depth first)."""
        yield self

    def forward(self, x: Array, ctx: Context) -> Array:
        raise NotImplementedError

    def replica(self) -> "Layer":
        """A twin sharing the parameters and gradients, with its own forward state."""
        return copy.copy(self)

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        raise NotImplementedError

    def attach(self, comm: Any) -> None:
        """The communicator of the ranks holding the model: a split twin keeps it."""

    def extent_read(self, in_shape: tuple[int, ...]) -> tuple[int, ...] | None:
        """The leading part of each spatial axis of ``in_shape`` this layer reads (None: all)."""
        return None

    def limit_output(self, *extent: int) -> None:
        """Compute only the ``extent`` of the output the next layer reads (if it can)."""

    def output_positions(self, out_shape: tuple[int, ...]) -> int:
        """Per sample, how many times the parameters are applied (a cost for pipeline cuts)."""
        return math.prod(out_shape[1:])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(str(getattr(self, a)) for a in self.repr_attrs)})"


class Chain(Layer):
    """Sublayers in order; a subclass may run them its own way, keeping nested parameters."""

    def __init__(self, layers: Mapping[str, Layer] | Sequence[Layer]) -> None:
        """Named by a mapping's keys, or by a sequence's positions ("0", "1", ...)."""
        super().__init__()
        owner, seq = type(self).__name__, not isinstance(layers, Mapping)
        self.children = {str(i): x for i, x in enumerate(layers)} if seq else dict(layers)
        if not self.children:
            raise ValueError(f"{owner}: needs at least one layer")
        for name, layer in self.children.items():
            if not isinstance(name, str) or not name or "." in name:
                why = "sublayer names must be non-empty strings without '.'"
                raise ValueError(f"{owner}: {why}, got {name!r}")
            if not isinstance(layer, Layer):
                raise TypeError(f"{owner}: sublayer {name!r} must be a Layer, got {layer!r}")

    def build(self, in_shape: tuple[int, ...], backend: Any, rng: Any) -> tuple[int, ...]:
        self.initial = {}  # a rebuild declares every nested parameter again
        return super().build(in_shape, backend, rng)

    def setup(self, in_shape: tuple[int, ...], rng: Any) -> tuple[int, ...]:
        for name in self.children:
            in_shape = self.build_child(name, in_shape, rng)
        return in_shape

    def build_child(self, name: str, in_shape: tuple[int, ...], rng: Any) -> tuple[int, ...]:
        """Build sublayer ``name`` on this layer's backend; declare its parameters as ours."""
        child = self.children[name]
        out = child.build(in_shape, self.backend, rng)
        self.initial |= {f"{name}.{key}": value for key, value in child.initial.items()}
        return out

    def bind(self, name: str, param: Array, grad: Array) -> None:
        super().bind(name, param, grad)
        child, _, rest = name.partition(".")
        self.children[child].bind(rest, param, grad)

    def walk(self) -> Iterator[Layer]:
        yield self
        for child in self.children.values():
            yield from child.walk()

    def forward(self, x: Array, ctx: Context) -> Array:
        for child in self.children.values():
            x = child.forward(x, ctx)
        return x

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        children = list(self.children.values())
        for i in range(len(children) - 1, -1, -1):
            dy = children[i].backward(dy, need_dx=need_dx or i > 0)
        return dy

    def replica(self) -> "Chain":
        twin = copy.copy(self)  # the same parameter views; each sublayer its own forward state
        twin.children = {name: child.replica() for name, child in self.children.items()}
        return twin

    def __repr__(self) -> str:
        return f"{type(self).__name__}({' -> '.join(map(repr, self.children.values()))})"


class Residual(Chain):
    """``y = x + f(x)``, ``f`` the sublayers in order; its output shape must be its input's."""

    def setup(self, in_shape: tuple[int, ...], rng: Any) -> tuple[int, ...]:
        out = super().setup(in_shape, rng)
        if tuple(out) != tuple(in_shape):
            why = "y = x + f(x) needs the same shape"
            raise ValueError(f"Residual: its layers map {tuple(in_shape)} to {tuple(out)}; {why}")
        return out

    def forward(self, x: Array, ctx: Context) -> Array:
        return x + super().forward(x, ctx)

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        # the sublayers' fused kernels may write over their dy: f gets a copy
        inner = super().backward(copy_array(self.xp, dy), need_dx)
        return dy + inner if need_dx else None
