"""Ranks on one node share the batch's activations; each computes some rows of every gradient.

``shared_update`` shares gradients: every rank writes the gradient of every weight over its own
samples, a row the size of the model, and the update sums the node's rows. At small batches
that is the larger thing to share. A Dense layer's weight gradient is ``x.T @ dz`` over the
batch, and what it is made of, the layer's inputs ``x`` and pre-activation gradients ``dz``,
holds ``batch x (fan_in + units)`` values against ``fan_in x units`` for the gradient: for the
MLP 784-1024-1024-10 at batch 128, 0.6 M values a step for the node against 1.9 M per rank.

So here each rank writes its samples' ``x`` and ``dz`` of every Dense layer into node-shared
arrays, and after a fence, rank r computes the gradient of its share of ``W``'s rows (and of
``b``) over all of the node's samples, one product over the node's batch as one process makes
it, and updates those rows at once while their gradient is still in cache. No rank writes a
gradient of the whole model, and none is summed.

With the activations in shared memory anyway, a wide layer's other products are split the
same way (``_UnitsLayer``): forward, rank r computes its units (columns of ``W``) for the
node's whole batch; backward, after a fence, the gradient of its inputs (rows of ``W``), which
are the units of the layer below that it owns there. Split by samples, every rank would read
all of ``W`` twice a step whatever its share of the batch; split by units, each reads its part.
Narrow layers (the 10-unit output) stay split by samples (``_SharedLayer``).

Within a layer split by samples, in this order: ``dz`` of my samples, put into the shared
arrays; ``dx = dz @ W.T`` for my samples (the last read of ``W`` in the step); fence; the
gradient of my rows; the update of my rows. Once everyone has passed the fence nobody reads
this ``W`` again in the step, so its rows can change. Split by units: ``dz`` of my units,
fence, ``dx`` of my inputs (my rows of ``W`` only), the gradient and the update of my rows.
The gradients wait for the end of a bucket of layers (``layer_buckets``: a small layer waits
for the next); a last fence before the next forward pass. Across nodes, a rank's rows of its
node's gradient are allreduced with the same rows on the other nodes (the ranks with the same
node-local rank) before the update, as ``shared_update`` does with its shares.
"""

from __future__ import annotations

import math
from typing import Any

from xpnn.data.batches import shard_bounds
from xpnn.errors import UserError
from xpnn.nn.dense import Dense
from xpnn.nn.sequential import Sequential
from xpnn.parallel.data_parallel import (
    MIN_LAYER_BUCKET,
    BucketCursor,
    LayerwiseUpdate,
    layer_buckets,
)
from xpnn.parallel.shared_update import ALIGN, NodeShared, share_bounds

Array = Any


def _param_layers(model: Any) -> list[Any]:
    return [layer for layer in model.layers if layer.initial]


def can_share_activations(model: Any) -> bool:
    """Whether every layer with parameters is a plain Dense of a plain model: other layers'
    gradients are not ``x.T @ dz``, tensor-parallel slices talk to other ranks, and a pipeline
    stage runs backward once per micro-batch."""
    return type(model) is Sequential and all(type(lay) is Dense for lay in _param_layers(model))


def activation_values(model: Any, batch_size: int) -> int:
    """How many values a step's shared activations hold: ``x`` and ``dz`` of each Dense."""
    return batch_size * sum(sum(layer.params["W"].shape) for layer in _param_layers(model))


def shares_activations(model: Any, batch_size: int, node_share: str) -> bool:
    """Whether the node's ranks share activations (``SharedBatchUpdate``) rather than gradients:
    as asked, or (``auto``) when the model allows it and the node's activations hold fewer
    values than the model has parameters, i.e. than one rank's gradient row. (Each rank writes
    a row and reads one row's worth in the update; with activations it writes its samples and
    reads the batch's. On 2 ranks the MLP 784-1024-1024-10 was 4-7 % faster sharing
    activations at batch 128, ~1.5 % slower at 512; this rule cuts at 381.)"""
    if node_share == "gradients":
        return False
    if not can_share_activations(model):
        if node_share == "activations":
            kinds = sorted({type(layer).__name__ for layer in _param_layers(model)} - {"Dense"})
            what = ", ".join(kinds) or type(model).__name__
            raise UserError(
                f"`node_share` activations: needs a model whose layers with parameters are all "
                f"Dense, this one has {what}; use `node_share` gradients"
            )
        return False
    return node_share == "activations" or activation_values(model, batch_size) < model.size


def row_align(units: int) -> int:
    """Cut ``W``'s rows at multiples of this, so that shares start on cache lines (as
    ``share_bounds`` cuts values) without rounding a share up by more: 1 for 1,024 units. (At
    ``ALIGN`` rows, 784 rows split 400 / 384, and rank 0's larger share kept rank 1 waiting.)"""
    return ALIGN // math.gcd(units, ALIGN)


class _Placement:
    """Where this rank's samples go in the node's shared arrays, for the current step."""

    def __init__(self, data_ranks: list[int], size: int, me: int) -> None:
        self.data_ranks, self.size, self.me = data_ranks, size, me
        self.lo = self.hi = self.total = 0
        self._batch = -1  # the global batch the bounds are for (all but an epoch's last)

    def lengths(self, global_batch: int) -> list[int]:
        """How many samples each rank of the node has, in node-local order."""
        bounds = (shard_bounds(global_batch, r, self.size) for r in self.data_ranks)
        return [hi - lo for lo, hi in bounds]

    def begin(self, global_batch: int) -> None:
        if global_batch == self._batch:
            return
        self._batch = global_batch
        lengths = self.lengths(global_batch)
        self.lo = sum(lengths[: self.me])
        self.hi = self.lo + lengths[self.me]
        self.total = sum(lengths)


class _SharedLayer:
    """One Dense layer's shared inputs and pre-activation gradients, and this rank's share.

    The layer runs its own forward and backward on this rank's samples; backward puts ``x``
    and ``dz`` here, and after a fence the rank computes its rows of the gradient over all of
    the node's samples. For the small layers (the MLP's 10-unit output).
    """

    splits_units = False

    def __init__(
        self, layer: Any, comm: Any, samples: int, place: _Placement, x: Array | None = None
    ) -> None:
        fan_in, units = layer.params["W"].shape
        dtype = layer.params["W"].dtype
        self.layer, self.place, self.comm = layer, place, comm
        # ``x`` given: the layer below splits its units and leaves its output there already
        self.inputs_shared = x is not None
        self.x = x if x is not None else comm.shared_zeros((samples, fan_in), dtype)
        self.dz = comm.shared_zeros((samples, units), dtype)
        me, size = comm.local_rank, comm.local_size
        self.rows = slice(*share_bounds(0, fan_in, size, me, row_align(units)))
        self.cols = slice(*share_bounds(0, units, size, me))

    def put(self, x: Array, dz: Array) -> None:
        """This rank's samples (called by ``Dense.backward``)."""
        lo, hi = self.place.lo, self.place.hi
        if not self.inputs_shared:
            self.x[lo:hi] = x
        self.dz[lo:hi] = dz

    def owes_fence(self, makes_dx: bool) -> bool:
        """Whether, when backward has finished this layer, a fence is owed before any rank
        may change its rows of ``W``: here every rank's samples were just put, and its
        ``dx`` read all of ``W``."""
        return True

    def grads_of_share(self) -> None:
        """This rank's rows of the gradient, over every sample the node's ranks put."""
        n = self.place.total
        self.layer.grads_of_share(self.x[:n], self.dz[:n], self.rows, self.cols)

    def parts(self, offset: int) -> tuple[slice, slice]:
        """This rank's share as slices of the flat buffers (the layer's W starts at
        ``offset``, row-major, then b)."""
        fan_in, units = self.layer.params["W"].shape
        w = slice(offset + self.rows.start * units, offset + self.rows.stop * units)
        b = offset + fan_in * units
        return w, slice(b + self.cols.start, b + self.cols.stop)


class _UnitsLayer(_SharedLayer):
    """A Dense layer whose products the node's ranks split by its weights, over the node's
    whole batch: rank r computes the units ``cols`` of the output (``W[:, cols]``) in
    forward, and the inputs ``rows`` of ``dx`` and the gradient of ``W[rows]`` in backward.

    Split by samples, every rank reads all of ``W`` twice a step (forward and ``dx``), whatever
    its share of the batch; split by units, each reads its part of ``W``, in products over the
    node's batch. Between two such layers nothing leaves shared memory: the output of one is
    the input of the next, and ``dx`` of one (inputs ``rows``) is the upper layer's gradient
    for the lower layer's units ``cols``, which are the same slice.
    """

    splits_units = True

    def __init__(
        self, layer: Any, comm: Any, samples: int, place: _Placement, below: _UnitsLayer | None
    ) -> None:
        super().__init__(layer, comm, samples, place, below.y if below else None)
        self.below = below
        self.y = comm.shared_zeros(self.dz.shape, self.dz.dtype)  # dz holds dy, then dz
        if below is not None:
            self.rows = below.cols
            below.grads_shared = True
        self.grads_shared = False  # whether the layer above leaves my gradient in ``dz``

    def forward(self, x: Array) -> Array:
        """My samples' outputs, after every rank computed its units for the node's batch."""
        place = self.place
        n = place.total
        if not self.inputs_shared:
            self.x[place.lo : place.hi] = x
            self.comm.fence()
        self.layer.forward_units(self.x[:n], self.cols, self.y[:n, self.cols])
        self.comm.fence()
        return self.y[place.lo : place.hi]

    def backward(self, dy: Array, need_dx: bool) -> Array | None:
        """``dz`` of my units, then (after a fence) ``dx`` of my inputs: straight into the
        layer below's ``dz`` if it splits its units too, else my samples' rows of it."""
        place = self.place
        n = place.total
        if not self.grads_shared:  # dy: my samples' rows
            self.dz[place.lo : place.hi] = dy
            self.comm.fence()
        self.layer.backward_units(self.dz[:n, self.cols], self.y[:n, self.cols], self.cols)
        self.comm.fence()
        if not need_dx:
            return None
        if self.below is not None:
            out = self.below.dz[:n, self.rows]
            self.layer.input_grad_rows(self.dz[:n], self.rows, out)
            return out
        return self.layer.input_grad(self.dz[place.lo : place.hi])

    def owes_fence(self, makes_dx: bool) -> bool:
        """Backward ends on a fence, then reads only this rank's rows of ``W``, unless it
        makes my samples' ``dx`` for a layer below that does not split its units."""
        return makes_dx and self.below is None

    def grads_of_share(self) -> None:
        """My rows of ``W``'s gradient (``b``'s share came with ``dz``, in backward)."""
        n = self.place.total
        self.layer.grads_of_share(self.x[:n], self.dz[:n], self.rows, None)


def splits_units(units: int, local_size: int) -> bool:
    """Whether the node's ranks split a Dense layer of ``units`` by its units: when each gets
    at least a cache line of every row."""
    return units >= ALIGN * local_size


class SharedBatchUpdate(NodeShared, LayerwiseUpdate):
    """The ``mpi-shm`` scheme that shares activations; built collectively by every rank.

    Layers go in the buckets ``LayerwiseUpdate`` cuts (a small layer rides with the next), so
    the MLP 784-1024-1024-10 has two fences in backward, as ``SharedUpdate`` does.
    """

    name = "shared activations"

    def __init__(self, model: Any, comm: Any, make_optimizer: Any, batch_size: int) -> None:
        params = self._share_params(model, comm, model.grads)  # the gradient stays private
        self.place = _Placement(comm.node.allgather(comm.rank), comm.size, comm.local_rank)
        samples = sum(self.place.lengths(batch_size))  # the node's share of a full batch
        bounds = layer_buckets(model.layer_offsets, model.size, MIN_LAYER_BUCKET)
        self.cursor = BucketCursor(bounds)
        self.layers: list[list[_SharedLayer]] = [[] for _ in bounds]  # by bucket
        self.parts: list[list[int]] = [[] for _ in bounds]  # the optimizer's, by bucket
        parts: list[slice] = []  # two per layer: my rows of W, my share of b
        # whether a bucket's gradients need a fence first: unless backward made one after the
        # bucket's last layer put its samples or read other ranks' rows of W (the same on
        # every rank: a rank without samples of a step still fences with the others)
        self.fence_first = [False for _ in bounds]
        below: Any = None  # the share of the layer just below, if it splits its units
        for index in range(len(model.layers)):
            layer, offset = model.layers[index], model.layer_offsets[index]
            share: Any = None
            if layer.initial:
                share = self._share(layer, comm, samples, below)
                layer.batch_share = share
                bucket = next(i for i, (lo, hi) in enumerate(bounds) if lo <= offset < hi)
                if not self.layers[bucket]:  # the bucket's lowest layer: backward ends there
                    self.fence_first[bucket] = share.owes_fence(model.needs_input_grad(index))
                self.layers[bucket].append(share)
                for part in share.parts(offset):
                    self.parts[bucket].append(len(parts))
                    parts.append(part)
            below = share if share is not None and share.splits_units else None
        shares = [share for bucket in self.layers for share in bucket]
        self.needs_every_rank = any(share.splits_units for share in shares)
        self.optimizer = make_optimizer(params, model.grads, parts, comm.shared_zeros)
        self.my_grads = [model.grads[part] for part in parts]
        self.grads_ready = self._ready
        comm.fence()

    def _share(self, layer: Any, comm: Any, samples: int, below: Any) -> _SharedLayer:
        """The layer's share: split by units if wide enough, fed by the layer below if that
        one is."""
        units = layer.params["W"].shape[1]
        if splits_units(units, comm.local_size):
            return _UnitsLayer(layer, comm, samples, self.place, below)
        x = below.y if below is not None else None
        return _SharedLayer(layer, comm, samples, self.place, x)

    def begin_step(self, global_batch: int) -> None:
        self.place.begin(global_batch)

    def _before_part(self, index: int) -> None:
        """Every rank's samples of the bucket's layers are in and nobody reads their weights
        any more (a fence, if backward has not just made one): compute this rank's rows of
        their gradients (summed across nodes)."""
        if self.fence_first[index]:
            self.comm.fence()
        for shared in self.layers[index]:
            shared.grads_of_share()
        if self.comm.nodes > 1:
            for part in self.parts[index]:
                self.comm.cross_allreduce_(self.my_grads[part])

    def _update(self, index: int) -> None:
        for part in self.parts[index]:
            self.optimizer.update_part(part)
