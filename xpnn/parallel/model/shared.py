"""Node sharing's model: buffers in node memory, Dense layers sharing ``x`` and ``dz``."""

import math
from typing import Any

from xpnn.data.datasets import shard_bounds
from xpnn.nn.dense import Dense
from xpnn.nn.layer import Array, Context
from xpnn.nn.sequential import Sequential
from xpnn.parallel.comm.shm import ALIGN, padded, share_bounds
from xpnn.record.phases import WGRAD


def param_layers(model: Any) -> list[Any]:
    return [layer for layer in model.layers if layer.initial]


def row_align(units: int) -> int:
    """The fewest rows of ``W`` that start a share on a cache line."""
    return ALIGN // math.gcd(units, ALIGN)


def splits_units(units: int, local_size: int) -> bool:
    """Whether the node's ranks split a Dense by units (each a cache line of every row)."""
    return units >= ALIGN * local_size


def forward_units(layer: Dense, x: Array, cols: slice, out: Array) -> None:
    z = layer.kernels.matmul_into(x, layer.params["W"][:, cols], out)
    y = layer.kernels.bias_act(z, layer.params["b"][cols], layer.activation)
    if y is not out:
        out[...] = y


def backward_units(layer: Dense, dy: Array, y: Array, cols: slice) -> None:
    """``dy`` of the units ``cols`` made ``dz`` in place; ``b[cols]``'s gradient assigned."""
    dz, db = layer.kernels.bias_act_backward(dy, y, layer.activation)
    if dz is not dy:
        dy[...] = dz
    layer.grads["b"][cols] = db


def input_grad_rows(layer: Dense, dz: Array, rows: slice, out: Array) -> None:
    layer.kernels.matmul_into(dz, layer.params["W"][rows].T, out)


def grads_of_rows(layer: Dense, x: Array, dz: Array, rows: slice, cols: slice | None) -> None:
    """Assign the gradients of ``W[rows]`` and ``b[cols]`` (if not None)."""
    with WGRAD:
        layer.kernels.matmul_into(x[:, rows].T, dz, layer.grads["W"][rows])
    if cols is not None:
        layer.grads["b"][cols] = layer.xp.sum(dz[:, cols], axis=0)


class Placement:
    """Where this rank's samples go in the node's shared arrays, for the current step."""

    def __init__(self, data_ranks: list[int], size: int, me: int) -> None:
        self.data_ranks, self.size, self.me = data_ranks, size, me
        self.lo = self.hi = self.total = 0
        self._batch = -1  # the global batch the bounds are for (all but an epoch's last)

    def lengths(self, global_batch: int) -> list[int]:
        bounds = (shard_bounds(global_batch, r, self.size) for r in self.data_ranks)
        return [hi - lo for lo, hi in bounds]

    def begin(self, global_batch: int) -> None:
        if global_batch != self._batch:
            self._batch, lengths = global_batch, self.lengths(global_batch)
            self.lo, self.total = sum(lengths[: self.me]), sum(lengths)
            self.hi = self.lo + lengths[self.me]


class SharedDense(Dense):
    """A built Dense whose backward shares ``x`` and ``dz``; ``share_grads`` makes W's gradient."""

    splits_units = False

    def __init__(self, dense: Dense, comm: Any, samples: int, place: Placement, below: Any):
        super().__init__(dense.units, dense.activation)
        self.backend, self.xp, self.kernels = dense.backend, dense.xp, dense.kernels
        self.params, self.grads, self.initial = dense.params, dense.grads, dense.initial
        fan_in, units = self.params["W"].shape
        dtype = self.params["W"].dtype
        self.place, self.node = place, comm
        self.inputs_shared = below is not None  # a layer below that splits its units: its output
        shape = (samples, fan_in)
        self.node_x = below.node_y if self.inputs_shared else comm.shared_zeros(shape, dtype)
        self.node_dz = comm.shared_zeros((samples, units), dtype)
        me, size = comm.local_rank, comm.local_size
        self.rows = slice(*share_bounds(0, fan_in, size, me, row_align(units)))
        self.cols = slice(*share_bounds(0, units, size, me))

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        dz, _ = self.kernels.bias_act_backward(dy, self.y, self.activation)
        lo, hi = self.place.lo, self.place.hi
        if not self.inputs_shared:
            self.node_x[lo:hi] = self.x
        self.node_dz[lo:hi] = dz
        return self.input_grad(dz) if need_dx else None

    def owes_fence(self, makes_dx: bool) -> bool:
        """Whether a fence is owed after backward before any rank changes its rows of ``W``."""
        return True

    def share_grads(self) -> None:
        """This rank's rows of the gradient, over every sample the node's ranks put."""
        n = self.place.total
        grads_of_rows(self, self.node_x[:n], self.node_dz[:n], self.rows, self.cols)

    def parts(self, offset: int) -> tuple[slice, slice]:
        """This rank's share of the flat buffers (W at ``offset``, row-major, then b)."""
        fan_in, units = self.params["W"].shape
        w = slice(offset + self.rows.start * units, offset + self.rows.stop * units)
        b = offset + fan_in * units
        return w, slice(b + self.cols.start, b + self.cols.stop)


class UnitsDense(SharedDense):
    """A built Dense whose node's ranks split its products by units (``cols``) and inputs."""

    splits_units = True

    def __init__(self, dense: Dense, comm: Any, samples: int, place: Placement, below: Any):
        super().__init__(dense, comm, samples, place, below)
        self.below = below
        self.node_y = comm.shared_zeros(self.node_dz.shape, self.node_dz.dtype)  # dz: dy, then dz
        if below is not None:
            self.rows = below.cols
            below.grads_shared = True
        self.grads_shared = False  # whether the layer above leaves my gradient in ``node_dz``

    def forward(self, x: Array, ctx: Context) -> Array:
        if not ctx.train:
            return super().forward(x, ctx)
        x, place = self.checked(x), self.place
        n = place.total
        if not self.inputs_shared:
            self.node_x[place.lo : place.hi] = x
            self.node.fence()
        forward_units(self, self.node_x[:n], self.cols, self.node_y[:n, self.cols])
        self.node.fence()
        return self.node_y[place.lo : place.hi]

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        """``dz`` of my units, then ``dx`` of my inputs (the layer below's ``dz`` if split)."""
        place, n = self.place, self.place.total
        if not self.grads_shared:  # dy: my samples' rows
            self.node_dz[place.lo : place.hi] = dy
            self.node.fence()
        backward_units(self, self.node_dz[:n, self.cols], self.node_y[:n, self.cols], self.cols)
        self.node.fence()
        if not need_dx:
            return None
        if self.below is not None:
            out = self.below.node_dz[:n, self.rows]
            input_grad_rows(self, self.node_dz[:n], self.rows, out)
            return out
        return self.input_grad(self.node_dz[place.lo : place.hi])

    def owes_fence(self, makes_dx: bool) -> bool:
        # backward ends on a fence; one is owed only if it then reads all of ``W`` for ``dx``
        return makes_dx and self.below is None

    def share_grads(self) -> None:
        # ``b``'s share came with ``dz``, in backward
        n = self.place.total
        grads_of_rows(self, self.node_x[:n], self.node_dz[:n], self.rows, None)


def share_layers(model: Sequential, comm: Any, samples: int, place: Placement) -> None:
    """Swap every Dense of the built ``model`` for its node-shared twin (collective)."""
    below: Any = None  # the layer just below, if it splits its units
    for index, layer in enumerate(model.layers):
        if layer.initial:
            wide = splits_units(layer.params["W"].shape[1], comm.local_size)
            layer = (UnitsDense if wide else SharedDense)(layer, comm, samples, place, below)
            model.layers[index] = layer
        below = layer if isinstance(layer, UnitsDense) else None


def share_params(model: Any, comm: Any, grads: Array) -> None:
    """``model``'s parameters moved to node memory (local rank 0's), its gradients to ``grads``."""
    params = comm.shared_zeros((model.size,), model.params.dtype)
    model.adopt(params, grads, copy=comm.local_rank == 0)


def share_gradients(model: Any, comm: Any) -> Array:
    """The node's gradient rows, one a rank, each starting on a page (collective)."""
    n, dtype = model.size, model.params.dtype
    stride = padded(n, 4096 // dtype.itemsize)  # on pages: end to end, one could start mid line
    rows = comm.shared_zeros((comm.local_size, stride), dtype)[:, :n]
    share_params(model, comm, rows[comm.local_rank])
    return rows


def share_activations(model: Sequential, comm: Any, batch_size: int) -> Placement:
    """Every Dense swapped for its twin sharing the node's batch; where this rank's samples go."""
    share_params(model, comm, model.grads)
    place = Placement(comm.node.allgather(comm.rank), comm.size, comm.local_rank)
    share_layers(model, comm, sum(place.lengths(batch_size)), place)  # the node's full batch
    return place
