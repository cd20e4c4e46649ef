"""One copy of the parameters per node; each rank sums and updates its own share of them.

The node's ranks keep the parameters, the optimizer state and one gradient row per rank in
shared memory: nothing is copied into messages, and each optimizer element is updated once
per node. As soon as backward has finished a bucket of layers, the ranks meet at a fence (every
row of the bucket is complete, no rank still reads its parameters), and rank r updates its
share of the bucket, summing every rank's row as it reads, while the gradients are still in
cache (across nodes, the node's sum of that share is first allreduced with the ranks of the
same local rank). A last fence: every share is updated before anyone's next forward pass.

The summed share is ``g_r + sum of the others``; with the loss scaled by 1 / global batch this
is the gradient of the global batch, so 1 rank and N ranks compute the same update.
"""

from __future__ import annotations

from typing import Any

from xpnn.parallel.comm.shm import padded, share_bounds
from xpnn.parallel.update.base import (
    MIN_LAYER_BUCKET,
    BucketCursor,
    LayerwiseUpdate,
    layer_buckets,
)

# Gradient rows start on pages. Laid end to end, row r starts r x (model size) values in:
# for the MLP 784-1024-1024-10, rank 1's row began 40 bytes into a cache line, so its weight
# gradient GEMMs wrote split lines, and ``ALIGN`` held for rank 0's row only.
ROW_ALIGN_BYTES = 4096


class NodeSharedUpdate(LayerwiseUpdate):
    """One copy of the parameters and the optimizer state per node: what the two schemes of a
    communicator with ``node_memory`` (``SharedUpdate``, ``shared_batch.SharedBatchUpdate``)
    have in common."""

    def _share_params(self, model: Any, comm: Any, grads: Any) -> Any:
        """Move the model's parameters into node-shared memory (node-local rank 0's values)
        and its gradients into ``grads``; returns the shared parameters."""
        self.model, self.comm = model, comm
        params = comm.shared_zeros((model.size,), model.params.dtype)
        model.adopt(params, grads, copy=comm.local_rank == 0)
        self.restores_checkpoint = comm.local_rank == 0  # one writer per shared buffer
        return params

    def broadcast_initial(self) -> None:
        """Node-local rank 0 wrote its parameters (``adopt``); across nodes, world rank 0's
        parameters and optimizer state go to the other nodes' local rank 0."""
        comm = self.comm
        if comm.nodes > 1 and comm.local_rank == 0:
            comm.cross.Bcast(self.model.params, root=0)
            for buf in self.optimizer.state.values():
                comm.cross.Bcast(buf, root=0)
        comm.fence()

    def finish(self) -> None:
        """After backward: update what is left, then fence before the next forward pass."""
        super().finish()
        self.comm.fence()  # every share is updated before anyone's next forward pass


class SharedUpdate(NodeSharedUpdate):
    """The ``mpi-shm`` scheme that shares gradients; built collectively by every rank."""

    name = "shared gradients"

    def __init__(self, model: Any, comm: Any, make_optimizer: Any) -> None:
        n, dtype = model.size, model.params.dtype
        stride = padded(n, ROW_ALIGN_BYTES // dtype.itemsize)
        rows = comm.shared_zeros((comm.local_size, stride), dtype)[:, :n]
        me = comm.local_rank
        params = self._share_params(model, comm, rows[me])
        bounds = layer_buckets(model.layer_offsets, n, MIN_LAYER_BUCKET)
        self.shares = [slice(*share_bounds(a, b, comm.local_size, me)) for a, b in bounds]
        self.cursor = BucketCursor(bounds)
        self.own = rows[me]
        self.others = [rows[r] for r in range(comm.local_size) if r != me]
        if comm.nodes > 1:  # the node's sum must exist to be allreduced: sum into own row
            grads = self.own
        else:  # the update sums the rows as it reads them
            grads = (self.own, *self.others) if self.others else self.own
        self.optimizer = make_optimizer(params, grads, self.shares, comm.shared_zeros)
        self.grads_ready = self._ready
        comm.fence()

    def _before_part(self, index: int) -> None:
        """Every rank's row of the bucket is complete and its weights are read; across nodes,
        this rank's share of the node's sum is allreduced with the same share elsewhere."""
        comm = self.comm
        comm.fence()
        if comm.nodes > 1:
            own = self.own[self.shares[index]]
            for other in self.others:
                own += other[self.shares[index]]
            comm.cross_allreduce_(own)
