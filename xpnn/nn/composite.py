"""Composites: sublayers' parameters declared as their own (``attn.qkv.W``), in the flat buffer."""

import copy
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from xpnn.nn.layer import Array, Context, Layer, copy_array


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
        shape = in_shape
        for name in self.children:
            shape = self.build_child(name, shape, rng)
        return shape

    def build_child(self, name: str, in_shape: tuple[int, ...], rng: Any) -> tuple[int, ...]:
        """Build sublayer ``name`` on this layer's backend; declare its parameters as ours."""
        child = self.children[name]
        out = child.build(in_shape, self.backend, rng)
        for key, value in child.initial.items():
            self.initial[f"{name}.{key}"] = value
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
        inner = " -> ".join(repr(child) for child in self.children.values())
        return f"{type(self).__name__}({inner})"


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
