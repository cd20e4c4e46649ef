"""What a step costs beyond its matrix products, measured on the model itself: one forward and
backward at a small batch on the run's backend, less its products' calibrated time, per sample.
The fused kernels (bias and activation, im2col, pooling, attention's softmax, LayerNorm, GELU)
differ too much between backends for one bandwidth to price them."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

from xpnn.planner.machine import Machine
from xpnn.planner.work import ModelWork

REST_BATCH = 32  # samples a measured step runs: enough rows to be the batch's, yet quick


def gemm_seconds(machine: Machine, work: ModelWork, batch: int, threads: int, dtype: str) -> float:
    total = 0.0
    for g in work.gemms():
        m, k, n, count = g.at(batch)
        total += machine.gemm_seconds(m, k, n, count, threads, dtype)
    return total


def time_step(model: Any, inputs: Any, labels: Any, threads: int, repeats: int = 5) -> float:
    """Median seconds of one forward and backward of ``model`` (built) on ``threads`` threads."""
    from threadpoolctl import threadpool_limits

    from xpnn.nn.layer import Context

    numba = _numba()
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


def _numba() -> Any:
    import sys

    return sys.modules.get("numba")


def measure_rest(
    machine: Machine,
    work: ModelWork,
    model: Any,
    classes: int,
    threads: int,
    dtype: str,
    seed: int = 0,
) -> float:
    """Seconds per sample of ``model``'s step beyond its products, at ``threads`` threads
    (``model`` built on its backend; never below zero)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    shape = (REST_BATCH, *work.input_shape)
    backend = model.backend
    if work.tokens_per_sample > 1:  # token ids in, a label for each position
        inputs = backend.asarray(rng.integers(0, classes, size=shape), dtype=np.int64)
        labels = backend.asarray(rng.integers(0, classes, size=shape), dtype=np.int64)
    else:
        inputs = backend.asarray(rng.standard_normal(shape))
        labels = backend.asarray(rng.integers(0, classes, size=(REST_BATCH,)), dtype=np.int64)
    step = time_step(model, inputs, labels, threads)
    products = gemm_seconds(machine, work, REST_BATCH, threads, dtype)
    return max(0.0, step - products) / REST_BATCH if math.isfinite(step) else 0.0
