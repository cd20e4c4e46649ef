"""Each model's training step against its own matrix products at this machine's GEMM rates.

For the MLP, the CNN and the GPT, a worker process per (backend, threads) builds the model,
notes the shape of every product a step runs (each Dense's and each convolution's forward,
weight-gradient and input-gradient GEMMs, im2col'd, with their transposes, and the attention's
batched products), times ``matmul`` alone at each shape (float32, median of ``--gemm-repeats``)
and then the step itself, layer by layer: every layer's forward and backward, the weight
gradients inside the backward (``xpnn.record.phases.WGRAD``), the loss and the Adam update.

Phases: forward; weight gradient (the WGRAD spans); input gradient (the rest of each
backward: its products and the activations' and layouts' passes); optimizer; the rest (the
loss). The products' time is what the step would take if it ran nothing but its GEMMs at the
rates measured for their shapes: the ratio step / products is how far the step is from it.
A convolution that runs directly (``Kernels.conv_direct_pays``) is charged the GEMM time of
the arithmetic im2col would have given it.

``--clock cpu`` times with ``time.process_time`` (the CPU time of all the process's threads):
on a machine others load, a 1-thread step's CPU time is what it costs, where its wall time
also holds the waits for a core.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Any

from bench.benchmarks import _limit_batch
from bench.core import markdown_table, median_of, record, run_command, spread
from bench.flags import choice_list, int_list, positive_float, positive_int

NAME = "limit"
SUMMARY = "each model's step, per layer and phase, against its matrix products at GEMM rates"
MODELS = ("mlp", "cnn", "gpt")
BACKENDS = ("numpy", "numba")
PHASES = ("forward", "wgrad", "igrad", "optimizer", "rest")
QUICK = {"batch": 4, "gpt_batch": 2, "repeats": 1, "gemm_repeats": 1, "hidden": [16, 8]}
QUICK |= {"layers": 1, "embed": 16, "heads": 2, "block": 8}
WORKER = "bench.benchmarks.limit"


def add_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--models", type=choice_list(MODELS), default=list(MODELS), help=",".join(MODELS))
    a("--backends", type=choice_list(BACKENDS), default=list(BACKENDS), help=",".join(BACKENDS))
    a("--threads", type=int_list, default=[1, 2], help="comma list of thread counts")
    a("--repeats", type=positive_int, default=10, help="timed steps (after 3 untimed)")
    a("--gemm-repeats", type=positive_int, default=10, help="timed products per shape")
    a("--clock", choices=["wall", "cpu"], default="wall", help="perf_counter or process_time")
    a("--batch", type=positive_int, default=128, help="the MLP's and the CNN's batch")
    a("--hidden", type=int_list, default=[512, 256], help="the MLP's hidden layers")
    a("--gpt-batch", type=positive_int, default=32, help="the GPT's sequences a step")
    for name, default in (("layers", 4), ("heads", 4), ("embed", 128), ("block", 64)):
        a(f"--{name}", type=positive_int, default=default, help=f"the GPT's {name}")
    a("--timeout", type=positive_float, default=1800, help="seconds allowed per worker")
    a("--batch-threads", type=positive_int, default=1, help="twins a process runs (the whole step)")


def run(args: argparse.Namespace, machine: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    _limit_batch.check(args)
    sizes = {k: getattr(args, k) for k in ("batch", "hidden", "gpt_batch", "layers")}
    sizes |= {k: getattr(args, k) for k in ("heads", "embed", "block")}
    for model in args.models:
        for backend in args.backends:
            for threads in args.threads:
                job = {"model": model, "backend": backend, "threads": threads, **sizes}
                job |= {"repeats": args.repeats, "gemm_repeats": args.gemm_repeats}
                job |= {"clock": args.clock, "batch_threads": args.batch_threads}
                worker_module = WORKER if args.batch_threads == 1 else _limit_batch.WORKER
                cmd = [sys.executable, "-m", worker_module, json.dumps(job)]
                result = json.loads(run_command(cmd, args.timeout).strip().splitlines()[-1])
                config = {k: job[k] for k in ("model", "backend", "threads", "clock")}
                config |= {"batch_threads": args.batch_threads} if args.batch_threads > 1 else {}
                config["command"] = "python -m bench limit " + " ".join(sys.argv[2:])
                samples = {"step_ms": result.pop("step_ms")}
                out.append(record(NAME, config, samples, machine, result))
                print(table(out[-1:]), flush=True)
    return out


# -- the products a step runs -----------------------------------------------------------------
# A product: (phase, batch count, M, K, N, A transposed, B transposed): C (M, N) = A (M, K) @ B


def _dense(layer: Any) -> list[tuple]:
    rows, f = layer.x.shape
    u = layer.units
    return [("forward", 1, rows, f, u, 0, 0), ("wgrad", 1, f, rows, u, 1, 0)] + [
        ("igrad", 1, rows, u, f, 0, 1)
    ]


def _conv(layer: Any, n: int) -> list[tuple]:
    c, kh, kw = layer.in_shape[0], layer.kh, layer.kw
    taps, co, p = c * kh * kw, layer.out_channels, n * math.prod(layer.used_hw)
    wgrad = ("wgrad", 1, taps, p, co, 0, 1) if taps >= co else ("wgrad", 1, co, p, taps, 0, 1)
    return [("forward", 1, co, taps, p, 0, 0), wgrad, ("igrad", 1, taps, co, p, 1, 0)]


def _attention(layer: Any) -> list[tuple]:
    b, h, t, d = layer.q.shape
    bh = b * h
    fwd = [("forward", bh, t, d, t, 0, 1), ("forward", bh, t, t, d, 0, 0)]
    bwd = [(bh, t, t, d, 1, 0), (bh, t, d, t, 0, 1), (bh, t, t, d, 0, 0), (bh, t, t, d, 1, 0)]
    return fwd + [("igrad", *s) for s in bwd]


def products(layer: Any, n: int, first: bool) -> list[tuple]:
    """Every product of ``layer`` (and the layers inside it) after a forward of ``n`` samples;
    ``first``: the model's first layer with parameters, whose input gradient nobody reads."""
    from xpnn.nn import CausalSelfAttention, Conv2D, Dense

    out: list[tuple] = []
    for inner in layer.walk():
        if isinstance(inner, Dense):
            out += _dense(inner)
        elif isinstance(inner, Conv2D):
            out += _conv(inner, n)
        elif isinstance(inner, CausalSelfAttention):
            out += _attention(inner)
    if first:  # Sequential asks no input gradient of it (nor of what it holds)
        out = [s for s in out if s[0] != "igrad"]
    return out


def gemm_ms(shape: tuple, repeats: int, clock: Any) -> float:
    """The median milliseconds of one float32 ``matmul`` of this shape, written into ``out``."""
    import numpy as np

    _, b, m, k, n, ta, tb = shape
    rng = np.random.default_rng(0)
    a = rng.random((b, k, m) if ta else (b, m, k), dtype=np.float32)
    bb = rng.random((b, n, k) if tb else (b, k, n), dtype=np.float32)
    a, bb = (a.transpose(0, 2, 1) if ta else a), (bb.transpose(0, 2, 1) if tb else bb)
    if b == 1:
        a, bb = a[0], bb[0]
    out = np.empty((b, m, n) if b > 1 else (m, n), dtype=np.float32)
    np.matmul(a, bb, out=out)
    times = []
    for _ in range(repeats):
        t = clock()
        np.matmul(a, bb, out=out)
        times.append(clock() - t)
    return 1e3 * statistics.median(times)


# -- the worker: one (model, backend, threads) --------------------------------------------------
def _model(job: dict[str, Any], backend: Any) -> tuple[Any, Any, Any]:
    """(model, inputs, labels) of one step."""
    import numpy as np

    from xpnn.nn import cnn, gpt, mlp

    rng = np.random.default_rng(0)
    if job["model"] == "gpt":
        vocab, n, t = 65, job["gpt_batch"], job["block"]  # tiny Shakespeare's characters
        sizes = {k: job[k] for k in ("layers", "heads", "embed", "block")}
        model = gpt(vocab, **sizes).build((t,), backend, 0)
        return model, rng.integers(0, vocab, (n, t)), rng.integers(0, vocab, (n, t))
    n = job["batch"]
    model = mlp(tuple(job["hidden"])) if job["model"] == "mlp" else cnn()
    model.build((1, 28, 28), backend, 0)
    return model, rng.random((n, 1, 28, 28), dtype=np.float32), rng.integers(0, 10, n)


class _WgradClock:
    """The time spent in ``xpnn.record.phases.WGRAD`` spans since the last ``take``."""

    def __init__(self, clock: Any) -> None:
        self.clock, self.total, self.since = clock, 0.0, 0.0

    def __call__(self, name: str, entering: bool) -> None:
        if name == "wgrad":
            if entering:
                self.since = self.clock()
            else:
                self.total += self.clock() - self.since

    def take(self) -> float:
        spent, self.total = self.total, 0.0
        return spent


def worker(job: dict[str, Any]) -> dict[str, Any]:
    from xpnn.runtime import HANDOFF, apply_threads

    apply_threads(job["threads"])  # before NumPy's BLAS and Numba start their pools
    import numpy as np

    from xpnn.backends import get_backend
    from xpnn.nn import Context
    from xpnn.record import phases

    clock = time.process_time if job["clock"] == "cpu" else time.perf_counter
    backend = get_backend(job["backend"], "float32")
    model, x, labels = _model(job, backend)
    layers, k, n = model.layers, backend.kernels, x.shape[0]
    m, v = np.zeros_like(model.params), np.zeros_like(model.params)
    wgrad = _WgradClock(clock)
    phases.listen(wgrad)
    ctx = Context(train=True, step=0, seed=0, sample_ids=np.arange(n))
    names = ("forward", "backward", "wgrad")
    per_layer: list[dict[str, list[float]]] = [{p: [] for p in names} for _ in layers]
    whole: dict[str, list[float]] = {"loss": [], "optimizer": [], "step": []}

    def step() -> None:
        start = h = clock()
        out = x
        for i, layer in enumerate(layers):
            out = layer.forward(out, ctx)
            t = clock()
            per_layer[i]["forward"].append(t - h)
            h = t
        loss, dy = model.loss(k, out, labels, 1.0 / n)
        t = clock()
        whole["loss"].append(t - h)
        h = t
        for i in range(len(layers) - 1, -1, -1):
            dy = layers[i].backward(dy, need_dx=model.needs_input_grad(i))
            t = clock()
            per_layer[i]["backward"].append(t - h)
            per_layer[i]["wgrad"].append(wgrad.take())
            h = t
        k.adam_update(model.params, model.grads, m, v, 1e-3, 0.9, 0.999, 1e-8, 1)
        t = clock()
        whole["optimizer"].append(t - h)
        whole["step"].append(t - start)

    for _ in range(3):  # Numba's compilation, first-touch of the buffers
        step()
    for series in [*per_layer, whole]:
        for values in series.values():
            values.clear()
    for _ in range(job["repeats"]):
        step()
    phases.listen(None)
    handoff = {var: os.environ.get(var) for var in HANDOFF}  # as NumPy's BLAS found them
    return _summary(job, layers, per_layer, whole, n, clock) | {"thread_handoff": handoff}


def _summary(job, layers, per_layer, whole, n, clock) -> dict[str, Any]:  # noqa: ANN001
    """Per layer: the medians of its phases' milliseconds and of its products' GEMM time."""
    rates: dict[tuple, float] = {}
    first = next(i for i, layer in enumerate(layers) if layer.params)
    rows = []
    for i, layer in enumerate(layers):
        med = {p: 1e3 * statistics.median(s) for p, s in per_layer[i].items()}
        row = {"layer": repr(layer), "forward": med["forward"], "wgrad": med["wgrad"]}
        row["igrad"] = med["backward"] - med["wgrad"]
        row |= {f"{p}_gemm": 0.0 for p in ("forward", "wgrad", "igrad")}
        row["gflop"] = 0.0
        for shape in products(layer, n, i == first):
            if shape not in rates:
                rates[shape] = gemm_ms(shape, job["gemm_repeats"], clock)
            row[f"{shape[0]}_gemm"] += rates[shape]
            row["gflop"] += 2e-9 * math.prod(shape[1:5])
        rows.append(row)
    ms = {p: 1e3 * statistics.median(s) for p, s in whole.items()}
    phase = {p: sum(r[p] for r in rows) for p in ("forward", "wgrad", "igrad")}
    phase |= {"optimizer": ms["optimizer"], "rest": ms["loss"]}
    gemm = {p: sum(r[f"{p}_gemm"] for r in rows) for p in ("forward", "wgrad", "igrad")}
    gemm |= {"optimizer": 0.0, "rest": 0.0}
    return {
        "step_ms": [1e3 * s for s in whole["step"]],
        "layers": rows,
        "phases": phase,
        "phase_gemm": gemm,
        "products_ms": sum(gemm.values()),
        "gflop": sum(r["gflop"] for r in rows),
        "shapes": len(rates),
    }


# -- tables -----------------------------------------------------------------------------------
def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def record_table(r: dict[str, Any]) -> str:
    """One record: a row per layer, a row per phase, and the whole step."""
    c, info = r["config"], r["info"]
    if "layers" not in info:
        return _limit_batch.table(r)
    heads = ["layer", "forward", "fwd GEMM", "wgrad", "wgrad GEMM", "igrad+rest", "igrad GEMM"]
    heads.append("x GEMM")
    rows = []
    for row in info["layers"]:
        spent = row["forward"] + row["wgrad"] + row["igrad"]
        gemm = row["forward_gemm"] + row["wgrad_gemm"] + row["igrad_gemm"]
        rows.append(
            [row["layer"], row["forward"], row["forward_gemm"], row["wgrad"], row["wgrad_gemm"]]
            + [row["igrad"], row["igrad_gemm"], _ratio(spent, gemm)]
        )
    ph, pg = info["phases"], info["phase_gemm"]
    total, gemm = sum(ph.values()), info["products_ms"]
    rows.append(["total of the layers", ph["forward"], pg["forward"], ph["wgrad"], pg["wgrad"]])
    rows[-1] += [ph["igrad"], pg["igrad"], None]
    phase_rows = [[p, ph[p], pg[p] or None, _ratio(ph[p], pg[p])] for p in PHASES]
    phase_rows.append(["total", total, gemm, _ratio(total, gemm)])
    phase_rows.append(["step (measured)", median_of(r, "step_ms"), gemm, None])
    phase_rows[-1][-1] = _ratio(median_of(r, "step_ms"), gemm)
    head = (
        f"{c['model']} on {c['backend']}, {c['threads']} thread(s), {c['clock']} clock: "
        f"median ms of {r['repeats']} steps, {info['gflop']:.3f} GFLOP of products a step\n\n"
    )
    return (
        head
        + markdown_table(heads, rows)
        + "\n\n"
        + markdown_table(["phase", "ms", "GEMM ms", "x GEMM"], phase_rows)
    )


def table(records: list[dict[str, Any]]) -> str:
    if not records:
        return "no records"
    summary = [
        [
            r["config"]["model"], r["config"]["backend"], _limit_batch.threads_label(r["config"]),
            spread(r, "step_ms"), r["info"]["products_ms"], r["info"]["gflop"],
            _ratio(median_of(r, "step_ms"), r["info"]["products_ms"]),
        ]
        for r in records
    ]  # fmt: skip
    heads = ["model", "backend", "threads", "step ms", "GEMM ms", "GFLOP", "x GEMM"]
    parts = [record_table(r) for r in records]
    return "\n\n".join([*parts, markdown_table(heads, summary)])


def plot(records: list[dict[str, Any]], ax: Any) -> None:
    labels = [
        f"{r['config']['model']}\n{r['config']['backend']} {r['config']['threads']}t"
        for r in records
    ]
    ax.bar(labels, [median_of(r, "step_ms") for r in records], label="step")
    ax.bar(labels, [r["info"]["products_ms"] for r in records], width=0.4, label="its GEMMs")
    ax.set(ylabel="ms per step (median)", title="steps against their matrix products")
    ax.legend(fontsize=7)


if __name__ == "__main__":
    print(json.dumps(worker(json.loads(sys.argv[1]))))
