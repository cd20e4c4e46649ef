"""One copy of the parameters a node: its ranks share gradient rows, or the activations."""

from typing import Any

from xpnn.errors import UserError
from xpnn.nn.dense import Dense
from xpnn.nn.sequential import Sequential
from xpnn.parallel.comm.shm import share_bounds
from xpnn.parallel.model.shared import SharedDense, param_layers
from xpnn.parallel.update.base import LayerwiseUpdate


class NodeSharedUpdate(LayerwiseUpdate):
    def __init__(self, model: Any, comm: Any, deferred: bool, wire: Any) -> None:
        super().__init__(model, comm, deferred)
        self.wire = wire  # the gradients cross nodes in a narrower float (``wire.GradWire``)
        self.restores_checkpoint = comm.local_rank == 0  # one writer per shared buffer

    def cross(self, grads: Any) -> None:
        if self.wire is None:
            self.comm.cross_allreduce_(grads)
        else:
            self.wire.cross_allreduce_(self.comm, grads)

    def share_total(self, local: float) -> float:
        # each rank of a node holds a share of the reduced gradient, each node all of it
        return float(self.comm.allreduce_host([local])[0]) / self.comm.nodes

    def broadcast_initial(self) -> None:
        """World rank 0's parameters and state to each node's local rank 0."""
        comm = self.comm
        if comm.nodes > 1 and comm.local_rank == 0:
            for buf in (self.model.params, *self.optimizer.state.values()):
                comm.cross_bcast_(buf)
        comm.fence()

    def finish(self) -> None:
        super().finish()
        self.comm.fence()  # every share is updated before anyone's next forward pass


class SharedUpdate(NodeSharedUpdate):
    """The ``mpi-shm`` scheme sharing the node's gradient ``rows``."""

    name = "shared gradients"

    def __init__(
        self, model: Any, comm: Any, make: Any, rows: Any, deferred: bool = False, wire: Any = None
    ) -> None:
        super().__init__(model, comm, deferred, wire)
        me, bounds = comm.local_rank, self.cursor.bounds
        self.shares = [slice(*share_bounds(a, b, comm.local_size, me)) for a, b in bounds]
        self.own = rows[me]
        self.others = [rows[r] for r in range(comm.local_size) if r != me]
        # the node's sum must exist to be allreduced, or (deferred) measured: sum into own row
        self.sums_own = comm.nodes > 1 or deferred  # else the optimizer sums them (sum_rows)
        grads = (self.own, *self.others) if self.others and not self.sums_own else self.own
        self.optimizer = make(model.params, grads, self.shares, comm.shared_zeros)
        comm.fence()

    def _before_part(self, index: int) -> None:
        self.comm.fence()
        if self.sums_own:
            own = self.own[self.shares[index]]
            for other in self.others:
                own += other[self.shares[index]]
            if self.comm.nodes > 1:
                self.cross(own)


def activation_values(model: Any, batch_size: int) -> int:
    """Values a step's shared activations hold: ``x`` and ``dz`` of each Dense."""
    return batch_size * sum(sum(layer.params["W"].shape) for layer in param_layers(model))


def shares_activations(model: Any, batch_size: int, node_share: str) -> bool:
    """As asked, or (``auto``) when allowed and fewer values than a rank's gradient row."""
    if node_share == "gradients":
        return False
    if not (type(model) is Sequential and all(type(lay) is Dense for lay in param_layers(model))):
        if node_share == "activations":
            kinds = sorted({type(layer).__name__ for layer in param_layers(model)} - {"Dense"})
            what = ", ".join(kinds) or type(model).__name__
            why = f"needs a model whose layers with parameters are all Dense, this one has {what}"
            raise UserError(f"`node_share` activations: {why}; use `node_share` gradients")
        return False
    return node_share == "activations" or activation_values(model, batch_size) < model.size


class SharedBatchUpdate(NodeSharedUpdate):
    """The ``mpi-shm`` scheme sharing activations; ``place``: where this rank's samples go."""

    name = "shared activations"

    def __init__(
        self, model: Any, comm: Any, make: Any, place: Any, deferred: bool = False, wire: Any = None
    ) -> None:
        super().__init__(model, comm, deferred, wire)
        self.place, bounds = place, self.cursor.bounds
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
        self.optimizer = make(model.params, model.grads, parts, comm.shared_zeros)
        self.my_grads = [model.grads[part] for part in parts]
        comm.fence()

    def begin_step(self, global_batch: int) -> None:
        self.place.begin(global_batch)

    def _before_part(self, index: int) -> None:
        if self.fence_first[index]:
            self.comm.fence()
        for layer in self.layers[index]:
            layer.share_grads()
        if self.comm.nodes > 1:
            for part in self.parts[index]:
                self.cross(self.my_grads[part])

    def _update(self, index: int) -> None:
        for part in self.parts[index]:
            self.optimizer.update_part(part)
