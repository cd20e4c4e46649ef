"""The Update contract, and the buckets every scheme cuts the flat gradient buffer into.

Parameters sit in one flat buffer in forward order, so backward completes gradients from the
end of the buffer towards the start (``Sequential.backward`` reports ``grads[offset:]`` final).
A scheme cuts the buffer into buckets from the end and acts on each as soon as backward has
finished it: reduce it (``allreduce``), or update it while its gradients are still in cache
(``LayerwiseUpdate``: ``local``, ``node_shared``, ``shared_batch``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

Array = Any
MIN_LAYER_BUCKET = 1 << 16  # elements; a smaller layer is updated with the next one


def layer_buckets(offsets: list[int], n: int, min_size: int) -> list[tuple[int, int]]:
    """[start, end) ranges covering ``range(n)``, last range first, cut only at ``offsets``
    (where a layer's parameters begin, i.e. where backward reports progress; or where
    allreduce buckets begin) and at least ``min_size`` long, except the range at the start
    of the buffer, which takes what is left."""
    bounds, end = [], n
    for cut in sorted({o for o in offsets if 0 < o < n}, reverse=True):
        if end - cut >= min_size:
            bounds.append((cut, end))
            end = cut
    if end > 0:
        bounds.append((0, end))
    return bounds


class BucketCursor:
    """Walks one step's buckets (last range first) as backward finishes them."""

    def __init__(self, bounds: list[tuple[int, int]]) -> None:
        self.bounds = bounds
        self._next = 0

    def finished(self, offset: int) -> Iterator[int]:
        """Indices of the buckets that ``grads[offset:]`` completes and were not yet seen."""
        while self._next < len(self.bounds) and self.bounds[self._next][0] >= offset:
            self._next += 1
            yield self._next - 1

    def rewind(self) -> None:
        """The step is over: the next one starts from the last bucket again."""
        self._next = 0


MakeOptimizer = Callable[..., Any]  # (params, grads, parts=None, zeros=None) -> Optimizer


class Update:
    """What the trainer calls: ``begin_step`` (with the global batch's size), ``grads_ready``
    (passed to backward), ``finish()`` after backward; ``broadcast_initial()`` once."""

    name: str  # what the metrics call the scheme
    # whether every rank runs forward and backward even without samples (the ranks split the
    # products of the node's batch between them); else a rank without samples adds zeros
    needs_every_rank = False

    def begin_step(self, global_batch: int) -> None:
        """A step over ``global_batch`` samples begins (a scheme that must know it overrides)."""


class LayerwiseUpdate(Update):
    """Updates each bucket of layers the moment backward has finished it.

    The update is memory-bound, and right after backward wrote a layer's gradients (and read
    its weights for the last time in the step) they are still in cache; after the whole
    backward pass, most of them are not. Subclasses set ``optimizer`` (one part per bucket)
    and ``cursor`` over the same buckets, and say in ``_before_part`` what makes a bucket's
    gradients final.
    """

    optimizer: Any
    cursor: BucketCursor

    def _before_part(self, index: int) -> None:
        """Make bucket ``index``'s gradients final on this rank (nothing to do alone)."""

    def _ready(self, offset: int) -> None:
        """Backward says ``grads[offset:]`` is final on this rank: update every bucket inside."""
        for i in self.cursor.finished(offset):
            if i == 0:  # the step's first bucket starts the step
                self.optimizer.start_step()
            self._before_part(i)
            self._update(i)

    def _update(self, index: int) -> None:
        """Run the optimizer on bucket ``index`` (one part of it, unless a subclass says)."""
        self.optimizer.update_part(index)

    def finish(self) -> None:
        """Update what backward did not report (all of it, when a rank had no samples)."""
        self._ready(0)
        self.cursor.rewind()
