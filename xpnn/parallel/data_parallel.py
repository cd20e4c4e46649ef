"""Data parallelism: gradient buckets reduced while the backward pass is still running.

Parameters sit in one flat buffer in forward order, so backward completes gradients from the end
of the buffer towards the start. The buffer is cut into buckets of about ``bucket_bytes`` from
the end; each bucket's non-blocking allreduce is launched the moment every gradient in it is
final (PyTorch DDP's buckets, Horovod's tensor fusion), and all are waited for before the
optimizer step. Each rank's gradient is already scaled by 1 / global batch, so the *sum* over
ranks is the gradient of the global mean loss: 1 rank and N ranks do the same mathematics.
"""

from __future__ import annotations

from typing import Any

Array = Any


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
        self._next = 0
        self._handles: list[Any] = []

    def ready(self, offset: int) -> None:
        """Backward says ``grads[offset:]`` is final: launch every bucket that lies inside."""
        if not self.active:
            return
        while self._next < len(self.bounds) and self.bounds[self._next][0] >= offset:
            start, end = self.bounds[self._next]
            self._handles.append(self.comm.iallreduce_(self.grads[start:end], "sum"))
            self._next += 1

    def finish(self) -> None:
        """Launch what is left and wait for all; the gradients are then the global ones."""
        if not self.active:
            return
        self.ready(0)
        for handle in self._handles:
            handle.wait()
        self._handles.clear()
        self._next = 0
