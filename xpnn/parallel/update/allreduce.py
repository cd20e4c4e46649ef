"""Data parallelism over any communicator: gradient buckets reduced while backward runs.

The buffer is cut into buckets of about ``bucket_bytes`` from the end; each bucket's
non-blocking allreduce is launched the moment every gradient in it is final (PyTorch DDP's
buckets, Horovod's tensor fusion), and all are waited for before the optimizer step. Each
rank's gradient is already scaled by 1 / global batch, so the *sum* over ranks is the gradient
of the global mean loss: 1 rank and N ranks do the same mathematics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from xpnn.parallel.update.base import (
    MIN_LAYER_BUCKET,
    Array,
    BucketCursor,
    MakeOptimizer,
    Update,
    layer_buckets,
)

DEFAULT_BUCKET_MB = 25.0  # allreduce buckets, as PyTorch DDP's bucket_cap_mb


def bucket_bounds(n: int, per_bucket: int) -> list[tuple[int, int]]:
    """[start, end) ranges covering ``range(n)``, last range first, each ``per_bucket`` long
    (the first range of the buffer takes the remainder)."""
    per_bucket = max(1, per_bucket)
    bounds = []
    end = n
    while end > 0:
        start = max(0, end - per_bucket)
        bounds.append((start, end))
        end = start
    return bounds


class GradientBuckets:
    """Launches each bucket's ``iallreduce_`` as soon as backward has filled it."""

    def __init__(self, grads: Array, comm: Any, bucket_bytes: int) -> None:
        self.grads, self.comm = grads, comm
        itemsize = grads.dtype.itemsize
        self.bounds = bucket_bounds(grads.shape[0], bucket_bytes // itemsize)
        self.active = comm.size > 1
        self._cursor = BucketCursor(self.bounds)
        self._handles: list[Any] = []
        self._waited = 0

    def ready(self, offset: int) -> None:
        """Backward says ``grads[offset:]`` is final: launch every bucket that lies inside."""
        if not self.active:
            return
        for i in self._cursor.finished(offset):
            start, end = self.bounds[i]
            self._handles.append(self.comm.iallreduce_(self.grads[start:end], "sum"))

    def wait(self, count: int) -> None:
        """Launch what is left, then wait until buckets ``0 .. count-1`` (in launch order:
        from the end of the buffer) hold the global gradients."""
        if not self.active:
            return
        self.ready(0)
        for handle in self._handles[self._waited : count]:
            handle.wait()
        self._waited = max(self._waited, count)

    def finish(self) -> None:
        """Wait for every bucket; the next step starts from the last bucket again."""
        self.wait(len(self.bounds))
        self._handles.clear()
        self._waited = 0
        self._cursor.rewind()


class AllreduceUpdate(Update):
    """Every rank holds all the parameters and runs the whole update on them.

    The gradients are summed by ``GradientBuckets`` while backward runs; any communicator
    works (one process, MPI, CUDA-aware MPI, NCCL), and ranks may sit on any nodes. The
    update goes part by part as the allreduces complete, each part right after the wait
    that made it final, while its summed gradients are still in cache. A part is one or
    more whole buckets, at least ``MIN_LAYER_BUCKET`` values, so tiny buckets do not cost
    one kernel call each.
    """

    name = "allreduce"

    def __init__(self, model: Any, comm: Any, make_optimizer: MakeOptimizer, bucket_bytes: int):
        self.model, self.comm = model, comm
        self.buckets = GradientBuckets(model.grads, comm, bucket_bytes)
        starts = [start for start, _ in self.buckets.bounds]
        parts = layer_buckets(starts, model.size, MIN_LAYER_BUCKET)
        # a part is final once the bucket that begins where the part begins is reduced
        self.waits = [starts.index(start) + 1 for start, _ in parts]
        self.optimizer = make_optimizer(model.params, model.grads, [slice(*p) for p in parts])
        self.grads_ready: Callable[[int], None] | None = self.buckets.ready
        self.restores_checkpoint = True  # every rank has its own buffers to fill

    def broadcast_initial(self) -> None:
        """Rank 0's parameters and optimizer state become everyone's."""
        self.comm.bcast_(self.model.params, 0)
        for buf in self.optimizer.state.values():
            self.comm.bcast_(buf, 0)

    def finish(self) -> None:
        """After backward: update each part as soon as its buckets hold the global sum."""
        self.optimizer.start_step()
        for index, count in enumerate(self.waits):
            self.buckets.wait(count)
            self.optimizer.update_part(index)
        self.buckets.finish()
