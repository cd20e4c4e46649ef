"""One process: nothing to exchange, each bucket of layers updated as backward finishes it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from xpnn.parallel.update.base import (
    MIN_LAYER_BUCKET,
    BucketCursor,
    LayerwiseUpdate,
    MakeOptimizer,
    layer_buckets,
)


class LocalUpdate(LayerwiseUpdate):
    """One process: nothing to exchange, buckets cut at layer boundaries."""

    name = "local"

    def __init__(self, model: Any, comm: Any, make_optimizer: MakeOptimizer) -> None:
        self.model, self.comm = model, comm
        bounds = layer_buckets(model.layer_offsets, model.size, MIN_LAYER_BUCKET)
        self.optimizer = make_optimizer(model.params, model.grads, [slice(*b) for b in bounds])
        self.cursor = BucketCursor(bounds)
        self.grads_ready: Callable[[int], None] | None = self._ready
        self.restores_checkpoint = True

    def broadcast_initial(self) -> None:
        """Nothing to send: one process."""
