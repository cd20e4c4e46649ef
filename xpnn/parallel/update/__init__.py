"""How a step's gradients become one update (``base.Update``); ``make_update`` picks the scheme."""

from __future__ import annotations

from typing import Any

from xpnn.errors import UserError
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
    deferred: bool = False,
    accumulate: int = 1,
    wire: Any = None,
) -> Update:
    """Local for one process; with node memory one copy per node, sharing gradients or
    activations (``node_share``); else a copy per rank kept equal by allreduce. ``deferred``:
    no part is updated before the whole gradient is reduced (clipping by the global norm);
    ``accumulate``: micro-steps a step sums (activations are shared for one batch at once);
    ``wire``: the gradients are sent between ranks in a narrower float (``wire.GradWire``)."""
    if comm.size == 1:
        return LocalUpdate(model, comm, make_optimizer, deferred)
    if comm.node_memory:
        if accumulate > 1 and node_share == "activations":
            raise UserError(
                "`node_share` activations: not with `accumulate` above 1 (the ranks share one "
                "batch's activations); use `node_share` gradients"
            )
        if accumulate == 1 and shares_activations(model, batch_size, node_share):
            return SharedBatchUpdate(model, comm, make_optimizer, batch_size, deferred, wire)
        return SharedUpdate(model, comm, make_optimizer, deferred, wire)
    return AllreduceUpdate(model, comm, make_optimizer, bucket_bytes, deferred, wire)


def uses_byte_buckets(comm: Any) -> bool:
    """Whether ``make_update`` cuts gradients into ``bucket_bytes`` buckets, not at layers."""
    return comm.size > 1 and not comm.node_memory


__all__ = ["DEFAULT_BUCKET_MB", "Update", "make_update", "uses_byte_buckets"]
