"""Tensor parallelism, Megatron-LM's pairs: the first split by columns, the second by rows."""

from typing import Any

import numpy as np

from xpnn.data.datasets import shard_bounds
from xpnn.errors import UserError
from xpnn.nn.dense import Dense
from xpnn.nn.layer import Array, Context, Layer


class SplitDense(Dense):
    """A Dense that keeps a slice of its parameters along ``split`` (name -> axis)."""

    split: dict[str, int] = {}

    def __init__(self, units: int, activation: str, bounds: tuple[int, int]) -> None:
        super().__init__(units, activation)
        self.lo, self.hi = bounds
        self.comm: Any = None  # ``attach``'s

    def attach(self, comm: Any) -> None:
        self.comm = comm

    def setup(self, in_shape: tuple[int, ...], rng: Any) -> tuple[int, ...]:
        out = super().setup(in_shape, rng)  # the whole initial weights
        self.whole_shapes = {name: shape for name, (_, shape) in self.initial.items()}
        for name, axis in self.split.items():
            value, shape = self.initial[name]
            shape = tuple(self.hi - self.lo if a == axis else n for a, n in enumerate(shape))
            value = self.piece(name, value) if isinstance(value, np.ndarray) else value
            self.initial[name] = (value, shape)
        return out  # the whole output shape: what the next layer is built against

    def piece(self, name: str, whole: np.ndarray) -> np.ndarray:
        axis = self.split.get(name)
        return whole if axis is None else np.take(whole, np.arange(self.lo, self.hi), axis=axis)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.units}, {self.activation}, [{self.lo}:{self.hi}])"


class ColumnDense(SplitDense):
    """Holds output units ``[lo:hi]``: its output is this rank's slice of the activations."""

    split = {"W": 1, "b": 0}

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        dx = super().backward(dy, need_dx)
        if dx is not None:  # each rank's units contribute a part of every input's gradient
            self.comm.allreduce_(dx, "sum")
        return dx


class RowDense(SplitDense):
    """Holds input rows ``[lo:hi]`` (the units the column-split layer before it computed)."""

    split = {"W": 0}

    def forward(self, x: Array, ctx: Context) -> Array:
        self.lead, self.x = tuple(x.shape[:-1]), self.checked(x)
        z = self.xp.matmul(self.x, self.params["W"])
        self.comm.allreduce_(z, "sum")  # every rank's rows: the whole pre-activation
        return self.activate(z)


def twin_of(layer: Any, which: int, bounds: tuple[int, int]) -> SplitDense:
    """``layer``'s first (0) or second (1) split twin, holding ``bounds``."""
    return (ColumnDense, RowDense)[which](layer.units, layer.activation, bounds)


def split_declared(layers: list[Layer], rank: int, size: int) -> list[Layer]:
    """Swap the sublayer pairs declared in ``tensor_pairs`` for this rank's split twins."""
    for top in layers:
        for layer in list(top.walk()):
            for column, row, column_group, row_group in layer.tensor_pairs:
                first, second = layer.children[column], layer.children[row]
                groups = first.units // column_group
                if groups < size:
                    why = f"splits into {groups} parts, fewer than the {size} ranks"
                    fix = f"use at most {groups} ranks a replica, or `parallel` data or pipeline"
                    raise UserError(f"`parallel` tensor: {layer!r} {why} ({fix})")
                lo, hi = shard_bounds(groups, rank, size)
                layer.children[column] = twin_of(first, 0, (lo * column_group, hi * column_group))
                layer.children[row] = twin_of(second, 1, (lo * row_group, hi * row_group))
    return layers


def split_layers(layers: list[Layer], rank: int, size: int) -> list[Layer]:
    """``layers`` with their pairs swapped for ``rank`` of ``size``'s twins; others refused."""
    if any(inner.tensor_pairs for top in layers for inner in top.walk()):
        return split_declared(layers, rank, size)
    pairable = [i for i, layer in enumerate(layers) if layer.tensor_split == "dense"]
    pairs = list(zip(pairable[0::2], pairable[1::2], strict=False))
    inside = {i for first, second in pairs for i in range(first + 1, second)}
    for i, layer in enumerate(layers):
        allowed = ("elementwise",) if i in inside else ("elementwise", "replicate", "dense")
        if layer.tensor_split not in allowed:
            where = "between a split pair " if i in inside else ""
            raise UserError(
                f"`parallel` tensor: {layer!r} cannot be split {where}(it declares "
                f"tensor_split {layer.tensor_split!r}); use `parallel` data or pipeline"
            )
    out = list(layers)
    for first, second in pairs:
        units = layers[first].units
        if units < size:
            what = f"a layer of {units} units cannot be split over {size} ranks"
            why = "each needs at least one unit; use `parallel` data or wider `hidden`"
            raise UserError(f"`parallel` tensor: {what} ({why})")
        bounds = shard_bounds(units, rank, size)
        out[first] = twin_of(layers[first], 0, bounds)
        out[second] = twin_of(layers[second], 1, bounds)
    return out
