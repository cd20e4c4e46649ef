"""What a step costs beyond its matrix products, measured on the model itself at two batches
(a cost per step and one per sample): fused kernels differ too much between backends for one
bandwidth to price them, and part of a step (dispatch, the loss) does not grow with the batch."""

from __future__ import annotations

import math
import statistics
import sys
import time
from typing import Any

from xpnn.planner.machine import Machine
from xpnn.planner.work import ModelWork

REST_BATCHES = (32, 128)  # enough rows to be the batch's, yet quick; two for the fit


def fit_rest(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(seconds a step, seconds a sample) through the rest at two batches, neither below zero:
    a rest that shrinks with the batch is all per step, one below zero at none all per sample."""
    (b1, r1), (b2, r2) = sorted(points)[:1] + sorted(points)[-1:]
    if b2 == b1:
        return 0.0, max(0.0, r1) / b1
    slope = (r2 - r1) / (b2 - b1)
    fixed = r1 - slope * b1
    if slope < 0:
        return max(0.0, r2), 0.0
    if fixed < 0:
        return 0.0, max(0.0, r2) / b2
    return fixed, slope


def time_step(model: Any, inputs: Any, labels: Any, threads: int, repeats: int = 5) -> float:
    """Median seconds of one forward and backward of ``model`` (built) on ``threads`` threads."""
    from threadpoolctl import threadpool_limits

    from xpnn.nn.layer import Context

    numba = sys.modules.get("numba")  # its threads, where the backend uses them
    before = numba.get_num_threads() if numba else None
    try:
        if numba:
            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        with threadpool_limits(limits=threads):
            ctx = Context(train=True, step=0)
            model.loss_and_grads(inputs, labels, ctx, 1.0)  # compiles, allocates
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                model.loss_and_grads(inputs, labels, ctx, 1.0)
                model.backend.synchronize()
                samples.append(time.perf_counter() - start)
    finally:
        if numba and before is not None:
            numba.set_num_threads(before)
    return statistics.median(samples)


def measure_rest(
    machine: Machine,
    work: ModelWork,
    model: Any,
    classes: int,
    threads: int,
    dtype: str,
    batches: tuple[int, ...] = REST_BATCHES,
) -> tuple[float, float]:
    """(seconds a step, seconds a sample) of ``model``'s (built) step beyond its products."""
    import numpy as np

    rng = np.random.default_rng(0)
    backend = model.backend
    points = []
    for batch in batches:
        shape = (batch, *work.input_shape)
        if work.tokens_per_sample > 1:  # token ids in, a label for each position
            inputs = backend.asarray(rng.integers(0, classes, size=shape), dtype=np.int64)
            labels = backend.asarray(rng.integers(0, classes, size=shape), dtype=np.int64)
        else:
            inputs = backend.asarray(rng.standard_normal(shape))
            labels = backend.asarray(rng.integers(0, classes, size=(batch,)), dtype=np.int64)
        step = time_step(model, inputs, labels, threads)
        if not math.isfinite(step):
            return 0.0, 0.0
        products = (machine.gemm_seconds(*g.at(batch), threads, dtype) for g in work.gemms())
        points.append((batch, step - sum(products)))
    return fit_rest(points)
