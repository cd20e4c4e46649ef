"""Ranks on one node share the batch's activations; each computes and updates its rows."""

from __future__ import annotations

from typing import Any

from xpnn.errors import UserError
from xpnn.parallel.model.shared import Placement, SharedDense, can_share_activations, param_layers
from xpnn.parallel.update.base import MIN_LAYER_BUCKET, BucketCursor, layer_buckets
from xpnn.parallel.update.node_shared import NodeSharedUpdate


def activation_values(model: Any, batch_size: int) -> int:
    """How many values a step's shared activations hold: ``x`` and ``dz`` of each Dense."""
    return batch_size * sum(sum(layer.params["W"].shape) for layer in param_layers(model))


def shares_activations(model: Any, batch_size: int, node_share: str) -> bool:
    """As asked, or (``auto``) when allowed and fewer values than a rank's gradient row."""
    if node_share == "gradients":
        return False
    if not can_share_activations(model):
        if node_share == "activations":
            kinds = sorted({type(layer).__name__ for layer in param_layers(model)} - {"Dense"})
            what = ", ".join(kinds) or type(model).__name__
            raise UserError(
                f"`node_share` activations: needs a model whose layers with parameters are all "
                f"Dense, this one has {what}; use `node_share` gradients"
            )
        return False
    return node_share == "activations" or activation_values(model, batch_size) < model.size


class SharedBatchUpdate(NodeSharedUpdate):
    """The ``mpi-shm`` scheme sharing activations, over the node-shared twins of the layers;
    ``place``: where this rank's samples go (collective)."""

    name = "shared activations"

    def __init__(
        self,
        model: Any,
        comm: Any,
        make_optimizer: Any,
        place: Placement,
        deferred: bool = False,
        wire: Any = None,
    ) -> None:
        self._node(model, comm, deferred, wire)
        self.place = place
        bounds = layer_buckets(model.layer_offsets, model.size, MIN_LAYER_BUCKET)
        self.cursor = BucketCursor(bounds)
        self.layers: list[list[SharedDense]] = [[] for _ in bounds]  # by bucket
        self.parts: list[list[int]] = [[] for _ in bounds]  # the optimizer's, by bucket
        parts: list[slice] = []  # two per layer: my rows of W, my share of b
        self.fence_first = [False] * len(bounds)  # before a bucket's gradients (on every rank)
        for index, layer in enumerate(model.layers):
            if not layer.initial:
                continue
            offset = model.layer_offsets[index]
            bucket = next(i for i, (lo, hi) in enumerate(bounds) if lo <= offset < hi)
            if not self.layers[bucket]:  # the bucket's lowest layer: backward ends there
                self.fence_first[bucket] = layer.owes_fence(model.needs_input_grad(index))
            self.layers[bucket].append(layer)
            for part in layer.parts(offset):
                self.parts[bucket].append(len(parts))
                parts.append(part)
        self.needs_every_rank = any(lay.splits_units for bucket in self.layers for lay in bucket)
        self.optimizer = make_optimizer(model.params, model.grads, parts, comm.shared_zeros)
        self.my_grads = [model.grads[part] for part in parts]
        comm.fence()

    def begin_step(self, global_batch: int) -> None:
        self.place.begin(global_batch)

    def _before_part(self, index: int) -> None:
        """Once every rank's samples are in: my rows of the bucket's gradients."""
        if self.fence_first[index]:
            self.comm.fence()
        for layer in self.layers[index]:
            layer.share_grads()
        if self.comm.nodes > 1:
            for part in self.parts[index]:
                self._cross_allreduce_(self.my_grads[part])

    def _update(self, index: int) -> None:
        for part in self.parts[index]:
            self.optimizer.update_part(part)
