"""Tensor parallelism, Megatron-LM's pairing: of each pair of Dense layers the first is split by
columns, the second by rows (one allreduce each way). The pairs are the ones a model's layers
declare (``Layer.tensor_pairs``: attention heads, a transformer's MLP), else an MLP's Dense
layers in turn; what is left is replicated. Every rank draws the whole initial weights and
keeps its slice."""

from __future__ import annotations

from typing import Any

import numpy as np

from xpnn.data.batches import shard_bounds
from xpnn.errors import UserError
from xpnn.nn.dense import Dense
from xpnn.nn.flatten import Flatten
from xpnn.nn.layer import Array, Layer


class _SplitDense(Dense):
    """A Dense that keeps a slice of its parameters along ``split`` (name -> axis)."""

    split: dict[str, int] = {}

    def __init__(self, units: int, activation: str, bounds: tuple[int, int]) -> None:
        super().__init__(units, activation)
        self.lo, self.hi = bounds
        self.comm: Any = None  # set by ``Sequential.attach`` once the communicator exists

    def setup(self, in_shape: tuple[int, ...], rng: Any) -> tuple[int, ...]:
        out = super().setup(in_shape, rng)  # the whole initial weights
        self.whole_shapes = {name: shape for name, (_, shape) in self.initial.items()}
        for name, axis in self.split.items():
            value, shape = self.initial[name]
            shape = tuple(self.hi - self.lo if a == axis else n for a, n in enumerate(shape))
            if isinstance(value, np.ndarray):
                value = self.piece(name, value)
            self.initial[name] = (value, shape)
        return out  # the whole output shape: what the next layer is built against

    def piece(self, name: str, whole: np.ndarray) -> np.ndarray:
        """This rank's slice of ``whole``, laid out as the whole parameter ``name``."""
        axis = self.split.get(name)
        return whole if axis is None else np.take(whole, np.arange(self.lo, self.hi), axis=axis)

    def __repr__(self) -> str:
        kind = type(self).__name__
        return f"{kind}({self.units}, {self.activation}, [{self.lo}:{self.hi}])"


class ColumnDense(_SplitDense):
    """Holds output units ``[lo:hi]``: its output is this rank's slice of the activations."""

    split = {"W": 1, "b": 0}

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        dx = super().backward(dy, need_dx)
        if dx is not None:  # each rank's units contribute a part of every input's gradient
            self.comm.allreduce_(dx, "sum")
        return dx


class RowDense(_SplitDense):
    """Holds input rows ``[lo:hi]`` (the units the column-split layer before it computed)."""

    split = {"W": 0}

    def complete(self, z: Array) -> Array:
        self.comm.allreduce_(z, "sum")  # every rank's rows: the whole pre-activation
        return z


def split_declared(layers: list[Layer], rank: int, size: int) -> list[Layer]:
    """Swap the Dense pairs each layer declares in ``tensor_pairs`` (attention heads, a
    transformer's MLP) for this rank's column- and row-split twins; the rest is replicated."""
    for top in layers:
        for layer in list(top.walk()):
            for column, row, column_group, row_group in layer.tensor_pairs:
                first, second = layer.children[column], layer.children[row]
                groups = first.units // column_group
                if groups < size:
                    raise UserError(
                        f"`parallel` tensor: {layer!r} splits into {groups} parts, fewer than "
                        f"the {size} ranks (use at most {groups} ranks a replica, or `parallel` "
                        "data or pipeline)"
                    )
                lo, hi = shard_bounds(groups, rank, size)
                bounds = (lo * column_group, hi * column_group)
                layer.children[column] = ColumnDense(first.units, first.activation, bounds)
                bounds = (lo * row_group, hi * row_group)
                layer.children[row] = RowDense(second.units, second.activation, bounds)
    return layers


def split_layers(layers: list[Layer], rank: int, size: int) -> list[Layer]:
    """``layers`` with their Dense layers paired into split ones for ``rank`` of ``size``:
    the pairs the layers declare (``Layer.tensor_pairs``), else an MLP's Dense layers in turn."""
    if any(inner.tensor_pairs for top in layers for inner in top.walk()):
        return split_declared(layers, rank, size)
    if not all(isinstance(layer, (Flatten, Dense)) for layer in layers):
        raise UserError("`parallel` tensor: only MLPs (Flatten and Dense layers) can be split")
    dense = [i for i, layer in enumerate(layers) if isinstance(layer, Dense)]
    out = list(layers)
    for first, second in zip(dense[0::2], dense[1::2], strict=False):
        units = layers[first].units
        if units < size:
            raise UserError(
                f"`parallel` tensor: a layer of {units} units cannot be split over {size} "
                "ranks (each needs at least one unit; use `parallel` data or wider `hidden`)"
            )
        bounds = shard_bounds(units, rank, size)
        out[first] = ColumnDense(units, layers[first].activation, bounds)
        out[second] = RowDense(layers[second].units, layers[second].activation, bounds)
    return out
