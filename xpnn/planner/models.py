"""A run's model built from its settings alone, its work, and its step's cost beyond products
measured on it at two batches (fused kernels differ too much between backends to price)."""

import dataclasses
import hashlib
import sys
from typing import Any

from xpnn.nn.gpt import GPT_DEFAULTS
from xpnn.planner.machine import Machine, median_time
from xpnn.planner.work import ModelWork, model_work

TEXT_VOCAB = 65  # Tiny Shakespeare's characters: the vocabulary when no text is at hand
PER_STEP = "per-step"  # a rest key's suffix: its seconds a step (the key alone: a sample's)
REST_BATCHES = (32, 128)  # enough rows to be the batch's, yet quick; two for the fit


def _model(spec: Any) -> tuple[Any, tuple[int, ...], int]:
    from xpnn.data.text import TEXT_DATASETS
    from xpnn.nn.models import build_model

    text = spec.dataset in TEXT_DATASETS
    shape, classes = ((spec.block,), TEXT_VOCAB) if text else ((1, 28, 28), 10)
    sizes = {name: getattr(spec, name) for name in GPT_DEFAULTS}
    model = build_model(
        spec.model, spec.hidden, spec.activation, classes, spec.loss, shape, gpt_sizes=sizes
    )
    return model, shape, classes


def work_of(spec: Any, machine: Machine | None = None, threads: tuple[int, ...] = ()) -> ModelWork:
    """``spec``'s per-sample work; with ``machine``, its rest at each of ``threads`` (kept)."""
    from xpnn.backends import get_backend

    model, shape, classes = _model(spec)
    work = model_work(model, shape, get_backend("numpy", spec.dtype), spec.seed)
    if machine is None or not threads:
        return work
    backend = get_backend(spec.backend, spec.dtype)
    layers = " -> ".join(repr(layer) for layer in getattr(model, "layers", [model]))
    digest = hashlib.sha256(f"{shape} {layers}".encode()).hexdigest()[:12]  # the model's name
    name = f"{backend.name} {spec.dtype} {{}} {digest}"
    for t in threads:
        key = name.format(t)
        if key not in machine.rest or f"{key} {PER_STEP}" not in machine.rest:
            if not machine.measured:  # a file measured elsewhere: what it holds (per sample)
                if key in machine.rest:
                    work.rest[t] = machine.rest[key]
                continue
            built = _model(spec)[0].build(shape, backend, spec.seed)
            fixed, slope = measure_rest(machine, work, built, classes, t, spec.dtype)
            machine.rest[key], machine.rest[f"{key} {PER_STEP}"] = slope, fixed
        work.rest[t] = machine.rest[key]
        work.rest_per_step[t] = machine.rest[f"{key} {PER_STEP}"]
    return work


HOST_BUFFER_BACKENDS = ("torch", "cupy")  # arrays node-shared memory cannot hold


def as_run(spec: Any, layout: Any) -> Any:
    """``layout`` on the transport ``spec``'s run takes (``auto``: node-shared on NumPy arrays)."""
    if layout.comm == "auto" and spec.backend in HOST_BUFFER_BACKENDS:
        return dataclasses.replace(layout, comm="mpi-host")
    return layout


def fit_rest(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(seconds a step, seconds a sample) through the rest at two batches, neither below zero."""
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


def time_step(model: Any, inputs: Any, labels: Any, threads: int) -> float:
    """Median seconds of one forward and backward of ``model`` (built) on ``threads`` threads."""
    from threadpoolctl import threadpool_limits

    from xpnn.nn.layer import Context

    numba = sys.modules.get("numba")  # its threads, where the backend uses them
    before = numba.get_num_threads() if numba else None
    ctx = Context(train=True, step=0)

    def step() -> None:
        model.loss_and_grads(inputs, labels, ctx, 1.0)  # the first compiles, allocates
        model.backend.synchronize()

    try:
        if numba:
            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        with threadpool_limits(limits=threads):
            return median_time(step, floor=0.0)
    finally:
        if numba and before is not None:
            numba.set_num_threads(before)


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
        products = (machine.gemm_seconds(*g.at(batch), threads, dtype) for g in work.gemms())
        points.append((batch, time_step(model, inputs, labels, threads) - sum(products)))
    return fit_rest(points)
