"""One copy of the parameters per node, with one gradient row per rank: once backward has
finished a bucket, the ranks fence and each sums the rows of its share and updates it."""

from __future__ import annotations

from typing import Any

from xpnn.parallel.comm.shm import share_bounds
from xpnn.parallel.update.base import MIN_LAYER_BUCKET, BucketCursor, LayerwiseUpdate, layer_buckets


class NodeSharedUpdate(LayerwiseUpdate):
    """The schemes with one copy of the parameters a node (``parallel.model.shared`` moved them)."""

    wire: Any = None  # the gradients cross nodes in a narrower float (``wire.GradWire``)

    def _node(self, model: Any, comm: Any, deferred: bool, wire: Any) -> None:
        self.model, self.comm, self.deferred, self.wire = model, comm, deferred, wire
        self.restores_checkpoint = comm.local_rank == 0  # one writer per shared buffer

    def _cross_allreduce_(self, grads: Any) -> None:
        """The node's sum of ``grads`` summed across nodes, sent as the wire says."""
        if self.wire is None:
            self.comm.cross_allreduce_(grads)
        else:
            self.wire.cross_allreduce_(self.comm, grads)

    def share_total(self, local: float) -> float:
        """Each rank of a node holds a share of the reduced gradient, each node all of it."""
        return float(self.comm.allreduce_host([local])[0]) / self.comm.nodes

    def broadcast_initial(self) -> None:
        """Across nodes, world rank 0's parameters and state go to each node's local rank 0."""
        comm = self.comm
        if comm.nodes > 1 and comm.local_rank == 0:
            comm.cross_bcast_(self.model.params)
            for buf in self.optimizer.state.values():
                comm.cross_bcast_(buf)
        comm.fence()

    def finish(self) -> None:
        super().finish()
        self.comm.fence()  # every share is updated before anyone's next forward pass


class SharedUpdate(NodeSharedUpdate):
    """The ``mpi-shm`` scheme sharing the node's gradient ``rows`` (collective)."""

    name = "shared gradients"

    def __init__(
        self,
        model: Any,
        comm: Any,
        make_optimizer: Any,
        rows: Any,
        deferred: bool = False,
        wire: Any = None,
    ) -> None:
        self._node(model, comm, deferred, wire)
        me = comm.local_rank
        bounds = layer_buckets(model.layer_offsets, model.size, MIN_LAYER_BUCKET)
        self.shares = [slice(*share_bounds(a, b, comm.local_size, me)) for a, b in bounds]
        self.cursor = BucketCursor(bounds)
        self.own = rows[me]
        self.others = [rows[r] for r in range(comm.local_size) if r != me]
        # the node's sum must exist to be allreduced, or (deferred) measured: sum into own row
        self.sums_own = comm.nodes > 1 or deferred
        if self.sums_own:
            grads = self.own
        else:  # the optimizer sums the rows (kernels.sum_rows) before it updates
            grads = (self.own, *self.others) if self.others else self.own
        self.optimizer = make_optimizer(model.params, grads, self.shares, comm.shared_zeros)
        comm.fence()

    def _before_part(self, index: int) -> None:
        """Fence: every row of the bucket is complete; across nodes, allreduce my share."""
        comm = self.comm
        comm.fence()
        if self.sums_own:
            own = self.own[self.shares[index]]
            for other in self.others:
                own += other[self.shares[index]]
            if comm.nodes > 1:
                self._cross_allreduce_(own)
