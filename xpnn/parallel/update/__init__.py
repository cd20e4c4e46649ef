"""How a step's gradients become one update; ``make_update`` picks the scheme.

``LocalUpdate`` (one process), ``AllreduceUpdate`` (a copy of the parameters per rank, kept
equal by bucketed allreduce over any communicator), and for communicators with
``node_memory`` one copy per node: ``SharedUpdate`` (the node's ranks share gradients) or
``SharedBatchUpdate`` (they share the batch's activations). The trainer sees one interface,
``base.Update``.
"""

from __future__ import annotations

from typing import Any

from xpnn.parallel.update.allreduce import DEFAULT_BUCKET_MB, AllreduceUpdate, bucket_bounds
from xpnn.parallel.update.base import MIN_LAYER_BUCKET, MakeOptimizer, Update, layer_buckets
from xpnn.parallel.update.local import LocalUpdate
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


__all__ = [
    "DEFAULT_BUCKET_MB",
    "MIN_LAYER_BUCKET",
    "AllreduceUpdate",
    "LocalUpdate",
    "SharedBatchUpdate",
    "SharedUpdate",
    "Update",
    "bucket_bounds",
    "layer_buckets",
    "make_update",
    "uses_byte_buckets",
]
