"""``batch_threads``: model twins on parts of a batch busy the cores one BLAS pass leaves idle."""

import dataclasses
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from xpnn.errors import UserError
from xpnn.record.phases import quiet_here
from xpnn.runtime.threads import one_kernel_thread

CPU_BACKENDS = ("numpy", "numba")  # arrays whose operations release the GIL on the host


def check_batch_threads(count: int, threads: int, backend: str) -> None:
    """Refuse the thread counts and backends ``batch_threads`` cannot run."""
    if count > 1 and threads % count:
        raise UserError(
            f"`batch_threads` {count}: does not divide this rank's {threads} thread(s) (`threads`)"
        )
    if count > 1 and backend not in CPU_BACKENDS:
        raise UserError(
            f"`batch_threads` {count}: the CPU backends only ({', '.join(CPU_BACKENDS)}), "
            f"not {backend}"
        )


def twin(model: Any) -> Any:
    """A copy of ``model`` on the same parameters with its own gradients and forward state."""
    other = model.replica()
    for layer in (inner for top in other.layers for inner in top.walk()):
        layer.params, layer.grads = dict(layer.params), dict(layer.grads)  # not the original's
    other.adopt(model.params, model.backend.xp.zeros_like(model.grads), copy=False)
    return other


class BatchThreads:
    """A rank's batch over threads, as ranks would but with one copy of the data, no allreduce."""

    def __init__(self, model: Any, count: int) -> None:
        one_kernel_thread()  # this thread runs a part too
        self.model = model
        self.twins = [model, *(twin(model) for _ in range(count - 1))]
        self.pool = ThreadPoolExecutor(
            count - 1, thread_name_prefix="xpnn-batch", initializer=_batch_thread
        )

    def loss_and_grads(
        self, x: Any, labels: Any, ctx: Any, scale: float, on_grads_ready: Callable | None = None
    ) -> tuple[Any, Any]:
        """Forward, loss and backward of the batch in parts; (loss sum, correct count)."""
        model, n = self.model, labels.shape[0]
        if n < 2:  # nothing to share out
            return model.loss_and_grads(x, labels, ctx, scale, on_grads_ready)
        xp = model.backend.xp
        ids = xp.arange(n, dtype=xp.int64) if ctx.sample_ids is None else ctx.sample_ids

        def run(who: Any, lo: int, hi: int) -> tuple[Any, Any]:
            sub = dataclasses.replace(ctx, sample_ids=ids[lo:hi])
            xs = None if x is None else x[lo:hi]
            return who.loss_and_grads(xs, labels[lo:hi], sub, scale)

        parts, results = self._over_threads(n, run)
        first = parts[0][0]
        if first is not model:  # fewer samples than threads left the model's part empty
            model.grads[...] = first.grads
        for who, _, _ in parts[1:]:
            model.grads += who.grads
        if on_grads_ready is not None:  # as the model's backward reports, last layer first
            for i in range(len(model.layers) - 1, -1, -1):
                on_grads_ready(model.layer_offsets[i])
        return _summed(results)

    def evaluate(self, x: Any, labels: Any) -> tuple[Any, Any]:
        """(loss sum, correct count) in evaluation mode, the samples shared out as in training."""
        if labels.shape[0] < 2:
            return self.model.evaluate(x, labels)

        def run(who: Any, lo: int, hi: int) -> tuple[Any, Any]:
            return who.evaluate(None if x is None else x[lo:hi], labels[lo:hi])

        return _summed(self._over_threads(labels.shape[0], run)[1])

    def _over_threads(self, n: int, run: Callable[..., Any]) -> tuple[list, list]:
        """``run(twin, lo, hi)`` on each non-empty part of ``n`` samples: parts and results."""
        count = len(self.twins)
        cuts = [n * i // count for i in range(count + 1)]
        bounds = zip(self.twins, cuts[:-1], cuts[1:], strict=True)
        parts = [(who, lo, hi) for who, lo, hi in bounds if hi > lo]
        futures = [self.pool.submit(run, *part) for part in parts[1:]]
        try:
            first = run(*parts[0])
        finally:  # no twin may still be writing when this call is over, even by an error
            wait(futures)
        return parts, [first] + [f.result() for f in futures]

    def close(self) -> None:
        self.pool.shutdown()


def _summed(results: list[tuple[Any, Any]]) -> tuple[Any, Any]:
    """The (loss, correct) pairs added up in thread order."""
    losses, corrects = zip(*results, strict=True)
    return sum(losses[1:], losses[0]), sum(corrects[1:], corrects[0])


def _batch_thread() -> None:
    """A batch thread: Numba's kernels on itself alone, its spans kept off the timeline."""
    one_kernel_thread()
    quiet_here()
