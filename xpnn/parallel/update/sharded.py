"""The optimizer state sharded over the data-parallel ranks (ZeRO stage 1, as DeepSpeed's and
FSDP's sharded optimizer): each rank keeps the state of one contiguous shard of the flat
parameters, 1 / N of it. Each gradient bucket is reduce-scattered as backward fills it (as
``AllreduceUpdate``'s buckets are allreduced): every rank receives the sum over its shard's
piece of the bucket alone. Each rank updates its shard as soon as the buckets under it are
final, then one all-gather makes the parameters whole again on every rank: a step sends one
gradient's bytes, as the allreduce. A checkpoint holds the whole state (``whole_state``), so
any rank count resumes it."""

from __future__ import annotations

from typing import Any

from xpnn.parallel.update.base import GradientBuckets, MakeOptimizer, Update

Array = Any


def shard_bounds(n: int, ranks: int) -> list[tuple[int, int]]:
    """[start, end) of each rank's shard of ``n`` values: contiguous, sizes differing by one."""
    per, extra = divmod(n, ranks)
    starts = [r * per + min(r, extra) for r in range(ranks + 1)]
    return list(zip(starts, starts[1:], strict=False))


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
    """What the trainer and checkpoints see of the shard's optimizer (``inner``): its step count,
    rate and norm; ``state`` is laid out over every parameter for a checkpoint to load into,
    allocated on first use and handed to the shard by ``ShardedUpdate.broadcast_initial``."""

    def __init__(self, inner: Any, n: int, bounds: tuple[int, int]) -> None:
        self.inner, self.n, self.bounds = inner, n, bounds
        self._whole: dict[str, Array] | None = None

    @property
    def step_count(self) -> int:
        return self.inner.step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        self.inner.step_count = value

    @property
    def lr(self) -> float:
        return self.inner.lr

    @property
    def grad_norm(self) -> float:
        return self.inner.grad_norm

    @property
    def schedule(self) -> Any:
        return self.inner.schedule

    @property
    def clip(self) -> Any:
        return self.inner.clip

    def end_step(self) -> None:
        self.inner.end_step()

    def add_pre_step_hook(self, hook: Any) -> None:
        self.inner.add_pre_step_hook(hook)

    def add_post_step_hook(self, hook: Any) -> None:
        self.inner.add_post_step_hook(hook)

    def add_skip_rule(self, rule: Any) -> None:
        self.inner.add_skip_rule(rule)

    @property
    def state(self) -> dict[str, Array]:
        """Whole-model buffers of each state a checkpoint restores (zeros until it does)."""
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


class ShardedUpdate(Update):
    """ZeRO stage 1 over the data-parallel ``comm``: the optimizer state 1 / N a rank."""

    name = "sharded"

    def __init__(
        self,
        model: Any,
        comm: Any,
        make_optimizer: MakeOptimizer,
        bucket_bytes: int,
        deferred: bool = False,
    ) -> None:
        self.model, self.comm, self.deferred = model, comm, deferred
        self.shards = shard_bounds(model.size, comm.size)
        lo, hi = self.shards[comm.rank]
        self.counts = [hi - lo for lo, hi in self.shards]
        self.buckets = ScatteredBuckets(model.grads, comm, bucket_bytes, self.shards)
        bounds = self.buckets.bounds  # last first, as backward finishes them
        edges = sorted({lo, hi, *(start for start, _ in bounds if lo < start < hi)})
        parts = list(zip(edges, edges[1:], strict=False))[::-1]
        # a part lies in one bucket: final once that bucket (and those launched before) is
        self.waits = [
            next(i for i, (s, e) in enumerate(bounds) if s <= a < e) + 1 for a, _ in parts
        ]
        inner = make_optimizer(
            model.params[lo:hi],
            model.grads[lo:hi],
            [slice(a - lo, b - lo) for a, b in parts],
            offset=lo,
        )
        self.optimizer = ShardedOptimizer(inner, model.size, (lo, hi))
        self.grads_ready = self.buckets.ready
        self.restores_checkpoint = True  # every rank reads the whole state, keeps its shard

    def share_total(self, local: float) -> float:
        """The shards' sums of squares added: each rank counts its own shard."""
        return float(self.comm.allreduce_host([local])[0])

    def broadcast_initial(self) -> None:
        """Rank 0's parameters become everyone's; a loaded state is cut to this rank's shard."""
        self.comm.bcast_(self.model.params, 0)
        self.optimizer.take_loaded()

    def finish(self) -> None:
        """After backward: update this rank's shard as its buckets are reduced, then gather
        the parameters (the gradients outside the shard are left undefined)."""
        inner = self.optimizer.inner
        if self.deferred:
            self.buckets.wait(len(self.buckets.bounds))
        inner.start_step()
        for index, count in enumerate(self.waits):
            self.buckets.wait(count)
            inner.update_part(index)
        self.buckets.finish()
        self._gather(self.model.params)

    def _gather(self, whole: Array) -> None:
        """Each shard of ``whole`` from the rank that holds it, to every rank."""
        self.comm.allgather_(whole, self.counts)

    def whole_state(self) -> dict[str, Array]:
        """Every state over every parameter, on every rank (collective): what checkpoints save."""
        xp = self.optimizer.inner.kernels.xp
        lo, hi = self.optimizer.bounds
        out = {}
        for name, shard in self.optimizer.inner.state.items():
            whole = xp.zeros((self.model.size,), dtype=shard.dtype)
            whole[lo:hi] = shard
            self._gather(whole)
            out[name] = whole
        return out
