"""A step's work per sample read from a model's layer shapes, and its cost beyond products
measured on the run's model at two batches (fused kernels differ too much to price)."""

import hashlib
import math
import sys
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from xpnn.backends import get_backend
from xpnn.data.text import TEXT_DATASETS
from xpnn.nn.gpt import GPT_DEFAULTS
from xpnn.nn.layer import Context
from xpnn.nn.models import build_model
from xpnn.planner.machine import Machine, median_time

FORWARD, WGRAD, DGRAD = "forward", "wgrad", "dgrad"
PHASES = (FORWARD, WGRAD, DGRAD)


@dataclass(frozen=True)
class Gemm:
    """``count`` products of (m x k) @ (k x n); the ``scales`` axis grows with the batch."""

    phase: str
    m: int
    k: int
    n: int
    scales: str = "m"
    count: int = 1

    def at(self, batch: int) -> tuple[int, int, int, int]:
        """(m, k, n, count) for ``batch`` samples."""
        dims = {"m": self.m, "k": self.k, "n": self.n, "count": self.count}
        dims[self.scales] *= batch
        return dims["m"], dims["k"], dims["n"], dims["count"]

    def flops(self, batch: int) -> float:
        m, k, n, count = self.at(batch)
        return 2.0 * m * k * n * count


@dataclass
class LayerWork:
    """One leaf layer's step: its products, its other passes' values, its parameters."""

    name: str
    gemms: list[Gemm] = field(default_factory=list)
    elementwise: int = 0  # values touched per sample, forward and backward together
    params: int = 0


@dataclass
class ModelWork:
    """The step of a whole model, per sample, and its parameters."""

    layers: list[LayerWork]
    params: int
    input_shape: tuple[int, ...]
    tokens_per_sample: int = 1  # a text model's positions per sample (tokens/s)
    top_layers: list[Any] = field(default_factory=list)  # the model's own, for the real checks
    rest: dict[int, float] = field(default_factory=dict)  # threads -> s a sample beyond products
    rest_per_step: dict[int, float] = field(default_factory=dict)  # threads -> s a step beyond

    def gemms(self) -> list[Gemm]:
        return [g for layer in self.layers for g in layer.gemms]

    def flops(self, batch: int) -> float:
        return sum(g.flops(batch) for g in self.gemms())

    def elementwise(self) -> int:
        return sum(layer.elementwise for layer in self.layers)


def _dense(layer: Any, in_shape: tuple[int, ...], name: str, first: bool) -> LayerWork:
    k, n = layer.initial["W"][1]
    rows = math.prod(in_shape[:-1])  # positions per sample (1, or T for a sequence)
    gemms = [Gemm(FORWARD, rows, k, n), Gemm(WGRAD, k, rows, n, scales="k")]
    gemms += [] if first else [Gemm(DGRAD, rows, n, k)]  # a first layer's input needs none
    return LayerWork(name, gemms, elementwise=3 * rows * n, params=k * n + n)


def _conv(layer: Any, in_shape: tuple[int, ...], out: tuple[int, ...], name: str, first: bool):
    c_out, c_in, kh, kw = layer.initial["W"][1]
    positions = math.prod(out[1:])
    depth = c_in * kh * kw
    columns = positions * depth  # im2col's values per sample, written and read
    values = 2 * columns + 3 * positions * c_out + (2 * columns if not first else 0)
    # oriented as ``Conv2D`` runs them: W (C_out x depth) @ cols (depth x N H'W'), the weight
    # gradient with the longer of depth and C_out as its rows, cols' gradient W.T @ dY
    wgrad = (depth, positions, c_out) if depth >= c_out else (c_out, positions, depth)
    gemms = [Gemm(FORWARD, c_out, depth, positions, scales="n"), Gemm(WGRAD, *wgrad, scales="k")]
    gemms += [] if first else [Gemm(DGRAD, depth, c_out, positions, scales="n")]
    return LayerWork(name, gemms, values, params=c_out * depth + c_out)


def _attention_core(layer: Any, in_shape: tuple[int, ...], name: str) -> LayerWork:
    """The heads' own products (scores and the weighted values) beside the Dense sublayers."""
    t, hd, heads = in_shape[0], layer.head_dim, layer.heads
    scores = Gemm(FORWARD, t, hd, t, scales="count", count=heads)  # q @ k.T
    weighted = Gemm(FORWARD, t, t, hd, scales="count", count=heads)  # p @ v
    backward = [Gemm(DGRAD, t, t, hd, scales="count", count=heads)] * 4  # dp, dv, dq, dk
    return LayerWork(name, [scores, weighted, *backward], elementwise=6 * heads * t * t)


def layer_work(
    layer: Any, in_shape: tuple[int, ...], name: str, rng: Any, first: bool
) -> tuple[tuple[int, ...], list[LayerWork], bool]:
    """(output shape, the leaves' work, whether a layer with parameters has been met)."""
    if isinstance(children := getattr(layer, "children", None), dict) and children:
        works: list[LayerWork] = []
        if hasattr(layer, "head_dim") and "qkv" in children:  # causal self-attention
            _, inner, first = layer_work(children["qkv"], in_shape, f"{name}.qkv", rng, first)
            works += inner + [_attention_core(layer, in_shape, f"{name}.heads")]
            out, inner, first = layer_work(children["proj"], in_shape, f"{name}.proj", rng, first)
            return out, works + inner, first
        shape = in_shape
        for key, child in children.items():
            shape, inner, first = layer_work(child, shape, f"{name}.{key}", rng, first)
            works += inner
        return shape, works, first
    out = tuple(layer.setup(tuple(in_shape), rng))
    kind = type(layer).__name__
    if "W" in layer.initial and len(layer.initial["W"][1]) == 2 and kind != "Embedding":
        work = _dense(layer, in_shape, f"{name} {kind}", first)
    elif "W" in layer.initial and len(layer.initial["W"][1]) == 4:
        work = _conv(layer, in_shape, out, f"{name} {kind}", first)
    else:  # elementwise, pooling, embeddings, norms: bandwidth, not products
        values = math.prod(in_shape) + math.prod(out) if kind != "Flatten" else 0  # a view
        params = sum(math.prod(shape) for _, shape in layer.initial.values())
        work = LayerWork(f"{name} {kind}", elementwise=2 * values, params=params)
    return out, [work], first and not layer.initial


def model_work(model: Any, input_shape: tuple[int, ...], backend: Any, seed: int = 0) -> ModelWork:
    """The per-sample work of ``model`` (a ``Sequential``), set up on ``backend``'s host."""
    model.setup(tuple(input_shape), backend, seed)
    rng = backend.host_rng(seed, 0)
    shape, works, first = tuple(input_shape), [], True
    for i, layer in enumerate(model.layers):
        shape, inner, first = layer_work(layer, shape, f"layer{i}", rng, first)
        works += inner
    params = sum(w.params for w in works)
    tokens = input_shape[0] if len(input_shape) == 1 else 1
    return ModelWork(works, params, tuple(input_shape), tokens, list(model.layers))


TEXT_VOCAB = 65  # Tiny Shakespeare's characters: the vocabulary when no text is at hand
PER_STEP = "per-step"  # a rest key's suffix: its seconds a step (the key alone: a sample's)
REST_BATCHES = (32, 128)  # enough rows to be the batch's, yet quick; two for the fit


def _model(spec: Any) -> tuple[Any, tuple[int, ...], int]:
    text = spec.dataset in TEXT_DATASETS
    shape, classes = ((spec.block,), TEXT_VOCAB) if text else ((1, 28, 28), 10)
    sizes = {name: getattr(spec, name) for name in GPT_DEFAULTS}
    model = build_model(
        spec.model, spec.hidden, spec.activation, classes, spec.loss, shape, gpt_sizes=sizes
    )
    return model, shape, classes


def work_of(spec: Any, machine: Machine | None = None, threads: tuple[int, ...] = ()) -> ModelWork:
    """``spec``'s per-sample work; with ``machine``, its rest at each of ``threads`` (kept)."""
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
        return replace(layout, comm="mpi-host")
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
