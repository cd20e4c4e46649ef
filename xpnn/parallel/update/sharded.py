"""The optimizer state sharded over the data-parallel ranks (ZeRO stage 1): each rank keeps the
state of one contiguous 1 / N shard of the flat parameters. Each gradient bucket is
reduce-scattered as backward fills it; each rank updates its piece once the bucket is final and
starts its all-gather while later buckets are waited for (one gradient's bytes a step, as the
allreduce). A checkpoint holds the whole state, so any rank count resumes it."""

from __future__ import annotations

from typing import Any

from xpnn.data.batches import shard_bounds as share_bounds
from xpnn.parallel.update.base import BucketedUpdate, GradientBuckets, MakeOptimizer, layer_buckets

Array = Any


def shard_bounds(n: int, ranks: int) -> list[tuple[int, int]]:
    """[start, end) of each rank's shard of ``n`` values, cut as a batch is between ranks."""
    return [share_bounds(n, rank, ranks) for rank in range(ranks)]


def piece_counts(start: int, end: int, shards: list[tuple[int, int]]) -> list[int]:
    """How many of ``[start, end)`` fall in each rank's shard: its reduce-scatter's pieces."""
    return [max(0, min(end, hi) - max(start, lo)) for lo, hi in shards]


class ScatteredBuckets(GradientBuckets):
    """Gradient buckets each reduced to the ranks whose shards it covers, not to every rank."""

    def __init__(
        self, grads: Array, comm: Any, bucket_bytes: int, shards: list[tuple[int, int]]
    ) -> None:
        super().__init__(grads, comm, bucket_bytes)
        self.counts = {s: piece_counts(s, e, shards) for s, e in self.bounds}

    def launch(self, start: int, end: int) -> Any:
        return self.comm.ireduce_scatter_(self.grads[start:end], self.counts[start])


class ShardedOptimizer:
    """The shard's optimizer (``inner``) as the trainer and checkpoints see it (as ChainerMN's
    wraps its own): ``state`` is laid out over every parameter for a checkpoint to load into,
    then handed to the shard by ``ShardedUpdate.broadcast_initial``."""

    def __init__(self, inner: Any, n: int, bounds: tuple[int, int]) -> None:
        self.inner, self.n, self.bounds = inner, n, bounds
        self._whole: dict[str, Array] | None = None

    def __getattr__(self, name: str) -> Any:  # what this class does not say: the shard's
        return getattr(self.inner, name)

    @property
    def step_count(self) -> int:
        return self.inner.step_count

    @step_count.setter
    def step_count(self, value: int) -> None:  # a resume sets it
        self.inner.step_count = value

    @property
    def state(self) -> dict[str, Array]:
        """Whole-model buffers a checkpoint restores into (zeros until it does)."""
        if self._whole is None:
            xp = self.inner.kernels.xp
            dtype = self.inner.params.dtype
            self._whole = {name: xp.zeros((self.n,), dtype=dtype) for name in self.inner.state}
        return self._whole

    def take_loaded(self) -> None:
        """A checkpoint loaded into ``state``: keep this rank's shard of it, free the rest."""
        if self._whole is None:
            return
        lo, hi = self.bounds
        for name, buf in self.inner.state.items():
            buf[...] = self._whole[name][lo:hi]
        self._whole = None


class ShardedUpdate(BucketedUpdate):
    """ZeRO stage 1 over the data-parallel ``comm``: the optimizer state 1 / N a rank."""

    name = "sharded"

    def _cut(self, bucket_bytes: int, wire: Any) -> GradientBuckets:
        """Buckets reduced to their shards' owners (the plan refuses a narrower ``wire``)."""
        self.shards = shard_bounds(self.model.size, self.comm.size)
        self.counts = [hi - lo for lo, hi in self.shards]
        self._gathers: list[Any] = []  # the all-gathers started this step, in bucket order
        return ScatteredBuckets(self.model.grads, self.comm, bucket_bytes, self.shards)

    def _parts(self) -> list[tuple[int, int]]:
        """This rank's shard, cut where buckets start: each part lies in one bucket."""
        lo, hi = self.shards[self.comm.rank]
        cuts = layer_buckets([start - lo for start, _ in self.buckets.bounds], hi - lo, 1)
        return [(a + lo, b + lo) for a, b in cuts]

    def _optimizer(self, make_optimizer: MakeOptimizer, parts: list[tuple[int, int]]) -> Any:
        """The shard's optimizer, over its slices of the flat buffers, seen whole."""
        lo, hi = self.shards[self.comm.rank]
        shard = [slice(a - lo, b - lo) for a, b in parts]
        model = self.model
        inner = make_optimizer(model.params[lo:hi], model.grads[lo:hi], shard, offset=lo)
        return ShardedOptimizer(inner, model.size, (lo, hi))

    def share_total(self, local: float) -> float:
        """The shards' sums of squares added: each rank counts its own shard."""
        return float(self.comm.allreduce_host([local])[0])

    def broadcast_initial(self) -> None:
        """Rank 0's parameters become everyone's; a loaded state is cut to this rank's shard."""
        self.comm.bcast_(self.model.params, 0)
        self.optimizer.take_loaded()

    def _updated(self, count: int) -> None:
        """Start the all-gather of each bucket below ``count`` not yet started (in bucket order
        on every rank): its pieces are updated everywhere."""
        for start, end in self.buckets.bounds[len(self._gathers) : count]:
            counts = self.buckets.counts[start]
            self._gathers.append(self.comm.iallgather_(self.model.params[start:end], counts))

    def finish(self) -> None:
        """After backward: the shard updated and gathered bucket by bucket; the parameters whole
        on return (the gradients outside the shard undefined)."""
        super().finish()
        for handle in self._gathers:
            handle.wait()
        self._gathers.clear()

    def whole_state(self) -> dict[str, Array]:
        """Every state over every parameter, on every rank (collective): what checkpoints save."""
        xp = self.optimizer.inner.kernels.xp
        lo, hi = self.optimizer.bounds
        out = {}
        for name, shard in self.optimizer.inner.state.items():
            whole = xp.zeros((self.model.size,), dtype=shard.dtype)
            whole[lo:hi] = shard
            self.comm.allgather_(whole, self.counts)
            out[name] = whole
        return out
