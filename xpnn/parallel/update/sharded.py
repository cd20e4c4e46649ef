"""The optimizer state sharded over the data-parallel ranks (ZeRO stage 1)."""

import functools
from typing import Any

from xpnn.data.datasets import shard_bounds as share_bounds
from xpnn.parallel.update.base import BucketedUpdate, GradientBuckets, MakeOptimizer, layer_buckets

Array = Any


def shard_bounds(n: int, ranks: int) -> list[tuple[int, int]]:
    """[start, end) of each rank's shard of ``n`` values, cut as a batch is."""
    return [share_bounds(n, rank, ranks) for rank in range(ranks)]


def piece_counts(start: int, end: int, shards: list[tuple[int, int]]) -> list[int]:
    """How many of ``[start, end)`` fall in each rank's shard."""
    return [max(0, min(end, hi) - max(start, lo)) for lo, hi in shards]


class ShardedOptimizer:
    """The shard's optimizer as trainer and checkpoints see it: ``state`` whole until cut."""

    def __init__(self, inner: Any, n: int, bounds: tuple[int, int]) -> None:
        self.inner, self.n, self.bounds = inner, n, bounds

    def __getattr__(self, name: str) -> Any:  # what this class does not say: the shard's
        return getattr(self.inner, name)

    @property
    def step_count(self) -> int:
        return self.inner.step_count

    @step_count.setter
    def step_count(self, value: int) -> None:  # a resume sets it
        self.inner.step_count = value

    @functools.cached_property
    def state(self) -> dict[str, Array]:
        xp, dtype = self.inner.kernels.xp, self.inner.params.dtype
        return {name: xp.zeros((self.n,), dtype=dtype) for name in self.inner.state}

    def take_loaded(self) -> None:
        """Keep this rank's shard of a loaded ``state``, free the rest."""
        if (whole := vars(self).pop("state", None)) is not None:  # cached: a checkpoint loaded it
            lo, hi = self.bounds
            for name, buf in self.inner.state.items():
                buf[...] = whole[name][lo:hi]


class ShardedUpdate(BucketedUpdate):
    """ZeRO stage 1 over the data-parallel ``comm``: the optimizer state 1 / N a rank."""

    name = "sharded"

    def _cut(self, bucket_bytes: int, wire: Any) -> GradientBuckets:
        # the plan refuses a narrower ``wire``
        self.shards = shard_bounds(self.model.size, self.comm.size)
        self.counts = [hi - lo for lo, hi in self.shards]
        self._gathers: list[Any] = []  # the all-gathers started this step, in bucket order
        buckets = GradientBuckets(self.model.grads, self.comm, bucket_bytes)
        buckets.counts = {s: piece_counts(s, e, self.shards) for s, e in buckets.bounds}
        return buckets

    def _parts(self) -> list[tuple[int, int]]:
        """This rank's shard, cut where buckets start: each part lies in one bucket."""
        lo, hi = self.shards[self.comm.rank]
        cuts = layer_buckets([start - lo for start, _ in self.buckets.bounds], hi - lo, 1)
        return [(a + lo, b + lo) for a, b in cuts]

    def _optimizer(self, make_optimizer: MakeOptimizer, parts: list[tuple[int, int]]) -> Any:
        lo, hi = self.shards[self.comm.rank]
        shard = [slice(a - lo, b - lo) for a, b in parts]
        model = self.model
        inner = make_optimizer(model.params[lo:hi], model.grads[lo:hi], shard, offset=lo)
        return ShardedOptimizer(inner, model.size, (lo, hi))

    def share_total(self, local: float) -> float:
        return float(self.comm.allreduce_host([local])[0])

    def broadcast_initial(self) -> None:
        self.comm.bcast_(self.model.params, 0)
        self.optimizer.take_loaded()

    def _updated(self, count: int) -> None:
        """Start the all-gather of each bucket below ``count`` not yet started, in bucket order."""
        for start, end in self.buckets.bounds[len(self._gathers) : count]:
            counts = self.buckets.counts[start]
            self._gathers.append(self.comm.iallgather_(self.model.params[start:end], counts))

    def finish(self) -> None:
        """The parameters whole on return (the gradients outside the shard undefined)."""
        super().finish()
        for handle in self._gathers:
            handle.wait()
        self._gathers.clear()

    def whole_state(self) -> dict[str, Array]:
        """Every state over every parameter, on every rank (collective)."""
        xp = self.optimizer.inner.kernels.xp
        lo, hi = self.optimizer.bounds
        out = {}
        for name, shard in self.optimizer.inner.state.items():
            whole = xp.zeros((self.model.size,), dtype=shard.dtype)
            whole[lo:hi] = shard
            self.comm.allgather_(whole, self.counts)
            out[name] = whole
        return out
