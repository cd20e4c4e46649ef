"""The Update contract, its buckets (cut from the end, as DDP's), schemes without node memory."""

from collections.abc import Callable, Iterator
from typing import Any

from xpnn.runtime import flight, stall

Array = Any
MIN_LAYER_BUCKET = 1 << 16  # elements; a smaller layer is updated with the next one
DEFAULT_BUCKET_MB = 25.0  # allreduce buckets, as PyTorch DDP's bucket_cap_mb


def bucket_bounds(n: int, per_bucket: int) -> list[tuple[int, int]]:
    """[start, end) ranges covering ``range(n)``, last first, ``per_bucket`` long but the first."""
    per_bucket = max(1, per_bucket)
    return layer_buckets(list(range(n - per_bucket, 0, -per_bucket)), n, per_bucket)


def layer_buckets(offsets: list[int], n: int, min_size: int) -> list[tuple[int, int]]:
    """[start, end) ranges over ``range(n)``, last first, cut at ``offsets``, ``min_size`` long."""
    bounds, end = [], n
    for cut in sorted({o for o in offsets if 0 < o < n}, reverse=True):
        if end - cut >= min_size:
            bounds.append((cut, end))
            end = cut
    if end > 0:
        bounds.append((0, end))
    return bounds


def uses_byte_buckets(comm: Any) -> bool:
    """Whether ``Plan.make_update`` cuts gradients into ``bucket_bytes`` buckets, not at layers."""
    return comm.size > 1 and not comm.node_memory


class BucketCursor:
    """Walks one step's buckets (last range first) as backward finishes them."""

    def __init__(self, bounds: list[tuple[int, int]]) -> None:
        self.bounds, self._next = bounds, 0

    def finished(self, offset: int) -> Iterator[int]:
        """Indices of the buckets that ``grads[offset:]`` completes and were not yet seen."""
        while self._next < len(self.bounds) and self.bounds[self._next][0] >= offset:
            self._next += 1
            yield self._next - 1

    def rewind(self) -> None:
        self._next = 0


class GradientBuckets:
    """Launches each bucket's reduction once backward has filled it; ``wire``: a narrower float."""

    def __init__(self, grads: Array, comm: Any, bucket_bytes: int, wire: Any = None) -> None:
        self.grads, self.comm, self.wire = grads, comm, wire
        itemsize = grads.dtype.itemsize if wire is None else wire.itemsize
        self.bounds = bucket_bounds(grads.shape[0], bucket_bytes // itemsize)
        self.counts: dict[int, list[int]] | None = None  # sharded: bucket start -> rank pieces
        self._cursor = BucketCursor(self.bounds)
        self._handles: list[Any] = []
        self._waited = 0

    def ready(self, offset: int) -> None:
        """Backward says ``grads[offset:]`` is final: launch every bucket that lies inside."""
        for i in self._cursor.finished(offset):
            start, end = self.bounds[i]
            flight.tag(bucket=i + 1)
            self._handles.append(self.launch(start, end))
            flight.tag()

    def launch(self, start: int, end: int) -> Any:
        if self.counts is not None:  # reduced to the ranks whose shards the bucket covers
            return self.comm.ireduce_scatter_(self.grads[start:end], self.counts[start])
        if self.wire is None:
            return self.comm.iallreduce_(self.grads[start:end], "sum")
        return self.wire.start(self.comm, self.grads[start:end])

    def wait(self, count: int) -> None:
        """Launch what is left, then wait for buckets ``0 .. count-1`` (in launch order)."""
        self.ready(0)
        for index in range(self._waited, min(count, len(self._handles))):
            stall.in_bucket(index, len(self.bounds))  # said if the wait stalls
            self._handles[index].wait()
        self._waited = max(self._waited, count)

    def finish(self) -> None:
        """Wait for every bucket; the next step starts from the last bucket again."""
        self.wait(len(self.bounds))
        self._handles.clear()
        self._waited = 0
        self._cursor.rewind()


MakeOptimizer = Callable[..., Any]  # (params, grads, parts=None, zeros=None) -> Optimizer


class Update:
    """Per step: ``begin_step``, ``grads_ready`` in backward, ``finish``; ``broadcast_initial``."""

    name: str  # what the metrics call the scheme
    optimizer: Any  # its ``state`` is what checkpoints save
    grads_ready: Callable[[int], None] | None  # None: the scheme waits for ``finish``
    restores_checkpoint = True  # whether this rank writes a checkpoint's values (shared: one)
    needs_every_rank = False  # every rank runs forward and backward, even without samples
    deferred = False  # updates wait for the whole reduced gradient (clipping by its norm)

    def begin_step(self, global_batch: int) -> None:
        pass

    def whole_state(self) -> dict[str, Any]:
        """What a checkpoint saves: the optimizer state over every parameter (collective)."""
        return self.optimizer.state

    def share_total(self, local: float) -> float:
        """A sum over this rank's part of the reduced gradient made the replica's."""
        return local


class BucketedUpdate(Update):
    """Buckets reduced as backward fills them; each part updated right after its last wait."""

    def __init__(
        self, model: Any, comm: Any, make: Any, cap: int, deferred: bool = False, wire: Any = None
    ) -> None:
        self.model, self.comm, self.deferred = model, comm, deferred
        self.buckets = self._cut(cap, wire)  # ``cap``: a bucket's bytes (DDP's bucket_cap_mb)
        bounds, parts = self.buckets.bounds, self._parts()  # both last first
        self.waits = [  # a part is final once the buckets up to the one holding its start are
            next(i for i, (s, e) in enumerate(bounds) if s <= a < e) + 1 for a, _ in parts
        ]
        self.optimizer = self._optimizer(make, parts)
        self.grads_ready = self.buckets.ready

    def _cut(self, bucket_bytes: int, wire: Any) -> GradientBuckets:
        return GradientBuckets(self.model.grads, self.comm, bucket_bytes, wire)

    def _parts(self) -> list[tuple[int, int]]:
        """[start, end) of the optimizer's parts, last first: runs of whole buckets."""
        starts = [start for start, _ in self.buckets.bounds]
        return layer_buckets(starts, self.model.size, MIN_LAYER_BUCKET)

    def _optimizer(self, make_optimizer: MakeOptimizer, parts: list[tuple[int, int]]) -> Any:
        return make_optimizer(self.model.params, self.model.grads, [slice(*p) for p in parts])

    def _updated(self, count: int) -> None:
        """Buckets ``0 .. count-1`` are updated on this rank."""

    def finish(self) -> None:
        if self.deferred:
            self.buckets.wait(len(self.buckets.bounds))
        self.optimizer.start_step()
        for index, count in enumerate(self.waits):
            self.buckets.wait(count)
            self.optimizer.update_part(index)
            self._updated(count)
        self._updated(len(self.buckets.bounds))
        self.buckets.finish()


class AllreduceUpdate(BucketedUpdate):
    """Every rank holds all the parameters, updated in parts of whole buckets."""

    name = "allreduce"

    def broadcast_initial(self) -> None:
        """Rank 0's parameters and optimizer state become everyone's."""
        for buf in (self.model.params, *self.optimizer.state.values()):
            self.comm.bcast_(buf, 0)


class LayerwiseUpdate(Update):
    """Updates each bucket of layers once backward has finished it, while it is in cache."""

    def __init__(self, model: Any, comm: Any, deferred: bool) -> None:
        self.model, self.comm, self.deferred = model, comm, deferred
        self.cursor = BucketCursor(layer_buckets(model.layer_offsets, model.size, MIN_LAYER_BUCKET))

    def _before_part(self, index: int) -> None:
        """Make bucket ``index``'s gradients final on this rank."""

    def grads_ready(self, offset: int) -> None:
        for i in self.cursor.finished(offset):
            if i == 0 and not self.deferred:  # the step's first bucket starts the step
                self.optimizer.start_step()
            self._before_part(i)
            if not self.deferred:
                self._update(i)

    def _update(self, index: int) -> None:
        self.optimizer.update_part(index)

    def finish(self) -> None:
        # what backward did not report (all of it, when a rank had no samples)
        self.grads_ready(0)
        if self.deferred:  # every bucket is final: now the step
            self.optimizer.start_step()
            for index in range(len(self.cursor.bounds)):
                self._update(index)
        self.cursor.rewind()


class LocalUpdate(LayerwiseUpdate):
    """One process: nothing to exchange, buckets cut at layer boundaries."""

    name = "local"

    def __init__(self, model: Any, comm: Any, make: MakeOptimizer, deferred: bool = False) -> None:
        super().__init__(model, comm, deferred)
        self.optimizer = make(model.params, model.grads, [slice(*b) for b in self.cursor.bounds])

    def broadcast_initial(self) -> None:
        pass
