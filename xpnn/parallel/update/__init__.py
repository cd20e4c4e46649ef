"""How a step's gradients become one update (``base.Update``); ``make_update`` picks the
scheme: ``LocalUpdate``, ``AllreduceUpdate`` (a copy per rank), or with ``node_memory`` one
copy per node, sharing gradients (``SharedUpdate``) or activations (``SharedBatchUpdate``)."""

from __future__ import annotations

from typing import Any

from xpnn.parallel.update.base import (
    DEFAULT_BUCKET_MB,
    AllreduceUpdate,
    LocalUpdate,
    MakeOptimizer,
    Update,
)
from xpnn.parallel.update.node_shared import SharedUpdate
from xpnn.parallel.update.shared_batch import SharedBatchUpdate, shares_activations


def make_update(
    model: Any,
    comm: Any,
    make_optimizer: MakeOptimizer,
    bucket_bytes: int,
    batch_size: int,
    node_share: str = "auto",
) -> Update:
    """The update scheme the communicator allows: none to talk to for one process; one copy
    of the parameters per node when it offers shared memory (``mpi-shm``), the node's ranks
    sharing their gradients or the batch's activations (``node_share``; ``auto``: whichever
    is smaller for ``batch_size``); else a copy per rank kept equal by allreduce."""
    if comm.size == 1:
        return LocalUpdate(model, comm, make_optimizer)
    if comm.node_memory:
        if shares_activations(model, batch_size, node_share):
            return SharedBatchUpdate(model, comm, make_optimizer, batch_size)
        return SharedUpdate(model, comm, make_optimizer)
    return AllreduceUpdate(model, comm, make_optimizer, bucket_bytes)


def uses_byte_buckets(comm: Any) -> bool:
    """Whether ``make_update`` cuts gradients into ``bucket_bytes`` buckets (allreduce); one
    process and node-shared memory cut them at layers instead."""
    return comm.size > 1 and not comm.node_memory


__all__ = ["DEFAULT_BUCKET_MB", "Update", "make_update", "uses_byte_buckets"]
