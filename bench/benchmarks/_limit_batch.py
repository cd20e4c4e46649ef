"""``bench limit --batch-threads K``: the step as a process of ``--threads`` threads runs it
with ``K`` batch threads (``xpnn.parallel.model.batch_threads``), against the products of
one thread's part of the batch at one BLAS thread: the twins run their parts side by side,
so a step at the GEMM rate takes one part's products (in wall time; ``--clock cpu`` counts
every part's). Layer by layer timing would interleave the twins' layers; the record holds
the whole step, and the products per phase."""

from __future__ import annotations

import json
import math
import sys
import time
from typing import Any

WORKER = "bench.benchmarks._limit_batch"


def check(args: Any) -> None:
    """Batch threads that divide every ``--threads`` count (the backends are CPU ones)."""
    from bench.core import BenchError

    for threads in args.threads:
        if threads % args.batch_threads:
            raise BenchError(
                f"--batch-threads {args.batch_threads}: does not divide --threads {threads}"
            )


def worker(job: dict[str, Any]) -> dict[str, Any]:
    from xpnn.runtime import apply_threads

    count = job["batch_threads"]
    apply_threads(max(1, job["threads"] // count))  # as ``python -m xpnn`` does
    import numpy as np

    from bench.benchmarks.limit import _model, gemm_ms, products
    from xpnn.backends import get_backend
    from xpnn.nn import Context
    from xpnn.parallel.model import BatchThreads

    clock = time.process_time if job["clock"] == "cpu" else time.perf_counter
    backend = get_backend(job["backend"], "float32")
    model, x, labels = _model(job, backend)
    n, k = x.shape[0], backend.kernels
    passes = BatchThreads(model, count)
    m, v = np.zeros_like(model.params), np.zeros_like(model.params)
    ctx = Context(train=True, step=0, seed=0, sample_ids=np.arange(n))
    steps: list[float] = []
    for i in range(3 + job["repeats"]):  # 3 untimed: Numba's compilation, first touches
        start = clock()
        passes.loss_and_grads(x, labels, ctx, 1.0 / n)
        k.adam_update(model.params, model.grads, m, v, 1e-3, 0.9, 0.999, 1e-8, 1)
        if i >= 3:
            steps.append(1e3 * (clock() - start))
    passes.close()
    part = math.ceil(n / count)  # the model is the first twin: its layers hold the first part
    first = next(i for i, layer in enumerate(model.layers) if layer.params)
    rates: dict[tuple, float] = {}
    # wall: the parts' products run side by side; CPU time: every part's products count
    per_part = count if job["clock"] == "cpu" else 1
    gemm, gflop = {p: 0.0 for p in ("forward", "wgrad", "igrad")}, 0.0
    for i, layer in enumerate(model.layers):
        for shape in products(layer, part, i == first):
            if shape not in rates:
                rates[shape] = gemm_ms(shape, job["gemm_repeats"], clock)
            gemm[shape[0]] += per_part * rates[shape]
            gflop += 2e-9 * per_part * math.prod(shape[1:5])
    return {
        "step_ms": steps,
        "batch_threads": count,
        "phase_gemm": gemm,
        "products_ms": sum(gemm.values()),
        "gflop": gflop,
        "shapes": len(rates),
    }


def threads_label(config: dict[str, Any]) -> str:
    """``2`` or ``2 (2 batch)``: the summary table's threads."""
    k = config.get("batch_threads", 1)
    return f"{config['threads']} ({k} batch)" if k > 1 else str(config["threads"])


def table(r: dict[str, Any]) -> str:
    """One record of the whole step: its products per phase, one thread's part at 1 thread."""
    from bench.core import markdown_table, median_of

    c, info = r["config"], r["info"]
    step, gemm = median_of(r, "step_ms"), info["products_ms"]
    rows = [[p, ms] for p, ms in info["phase_gemm"].items()]
    parts = "every thread's part" if c["clock"] == "cpu" else "one thread's part"
    rows += [["products", gemm], ["step (measured)", step], ["x GEMM", step / gemm]]
    head = (
        f"{c['model']} on {c['backend']}, {c['threads']} thread(s), {info['batch_threads']} "
        f"batch threads, {c['clock']} clock: median ms of {r['repeats']} steps against the "
        f"products of {parts} at one BLAS thread ({info['gflop']:.3f} GFLOP); at the GEMM "
        f"rate: {100 * gemm / step:.0f} %\n\n"
    )
    return head + markdown_table(["phase", "GEMM ms"], rows)


if __name__ == "__main__":
    print(json.dumps(worker(json.loads(sys.argv[1]))))
