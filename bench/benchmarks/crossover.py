"""CPU vs GPU matrix product, the copies counted: where does the GPU start to win?

The CPU product is NumPy's (its BLAS, threads as it has them). With CuPy and a device, the
parts are timed apart: host->device copy of the inputs, the kernel alone (CUDA events), the
device->host copy of the result, and the round trip, from pageable and from pinned memory.
Without a GPU the GPU columns are empty and the record says why. Shapes: a square sweep and
a 2016 blog post's 120x30 @ 30x20 (where its GPU lost), MNIST-sized layer products.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.core import markdown_table, median_of, record
from bench.flags import int_list

NAME = "crossover"
SUMMARY = "CPU vs GPU matmul time, copies counted; where the GPU starts to win"
QUICK = {"sizes": [16, 64, 256], "repeats": 3, "extra": False}
EXTRA = ((120, 30, 20), (128, 784, 512), (60000, 784, 512))
GPU_COLUMNS = ("h2d_ms", "kernel_ms", "d2h_ms", "e2e_ms", "h2d_pinned_ms", "d2h_pinned_ms")
GPU_COLUMNS += ("e2e_pinned_ms",)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", type=int_list, default=[16, 64, 128, 256, 512, 1024, 2048, 4096])
    p.add_argument("--dtypes", default="float32,float64")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-extra", dest="extra", action="store_false", help="square sizes only")
    p.add_argument("--no-gpu", action="store_true", help="time the CPU only")


def _wall_ms(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> list[float]:
    fn()
    sync()  # warm-up: BLAS threads, cuBLAS handles and memory pools settle
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _pinned(cp: Any, x: np.ndarray) -> np.ndarray:
    """A page-locked copy of ``x``: the copies to and from it run at the link's full speed."""
    mem = cp.cuda.alloc_pinned_memory(max(1, x.nbytes))
    out = np.frombuffer(mem, x.dtype, x.size).reshape(x.shape)
    out[...] = x
    return out


def _gpu_samples(cp: Any, a: np.ndarray, b: np.ndarray, repeats: int) -> dict[str, list[float]]:
    sync = cp.cuda.Device().synchronize
    da, db = cp.asarray(a), cp.asarray(b)
    dc = da @ db
    c = np.empty(dc.shape, dc.dtype)
    pin_a, pin_b, pin_c = (_pinned(cp, x) for x in (a, b, c))
    out: dict[str, list[float]] = {
        "h2d_ms": _wall_ms(lambda: (cp.asarray(a), cp.asarray(b)), repeats, sync),
        "d2h_ms": _wall_ms(lambda: cp.asnumpy(dc), repeats, sync),
        "e2e_ms": _wall_ms(lambda: cp.asnumpy(cp.asarray(a) @ cp.asarray(b)), repeats, sync),
        "h2d_pinned_ms": _wall_ms(lambda: (cp.asarray(pin_a), cp.asarray(pin_b)), repeats, sync),
        "d2h_pinned_ms": _wall_ms(lambda: dc.get(out=pin_c), repeats, sync),
        "e2e_pinned_ms": _wall_ms(
            lambda: (cp.asarray(pin_a) @ cp.asarray(pin_b)).get(out=pin_c), repeats, sync
        ),
    }
    kernel = []
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(repeats):
        start.record()
        da @ db
        stop.record()
        stop.synchronize()
        kernel.append(cp.cuda.get_elapsed_time(start, stop))
    out["kernel_ms"] = kernel
    return out


def _cupy(disabled: bool) -> tuple[Any, str | None]:
    if disabled:
        return None, "--no-gpu"
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
        return cupy, None
    except Exception as e:  # no CuPy or no usable device: the CPU columns still count
        return None, f"no GPU here ({type(e).__name__}: {str(e).splitlines()[0][:80]})"


def run(args: argparse.Namespace, machine: dict[str, Any]) -> list[dict[str, Any]]:
    cp, why = _cupy(args.no_gpu)
    shapes = [(n, n, n) for n in args.sizes] + (list(EXTRA) if args.extra else [])
    rng = np.random.default_rng(0)
    out = []
    for dtype in [d for d in args.dtypes.split(",") if d]:
        for m, k, n in shapes:
            a = rng.standard_normal((m, k)).astype(dtype)
            b = rng.standard_normal((k, n)).astype(dtype)
            samples = {"cpu_ms": _wall_ms(lambda a=a, b=b: a @ b, args.repeats, lambda: None)}
            if cp is not None:
                samples |= _gpu_samples(cp, a, b, args.repeats)
            config = {"m": m, "k": k, "n": n, "shape": f"{m}×{k} @ {k}×{n}", "dtype": dtype}
            out.append(record(NAME, config, samples, machine, {"gpu_skipped": why}))
    return out


def squares(records: list[dict[str, Any]], dtype: str) -> list[dict[str, Any]]:
    """The square products of one dtype, smallest first."""
    sq = [r for r in records if r["config"]["dtype"] == dtype]
    sq = [r for r in sq if r["config"]["m"] == r["config"]["k"] == r["config"]["n"]]
    return sorted(sq, key=lambda r: r["config"]["n"])


def wins_from(records: list[dict[str, Any]], dtype: str, column: str) -> int | None:
    """The smallest square n from which the GPU (``column``) stays ahead of the CPU."""
    sq = squares(records, dtype)
    win = None
    for r in sq:
        gpu, cpu = median_of(r, column), median_of(r, "cpu_ms")
        if gpu is None:
            return None
        win = (win or r["config"]["n"]) if gpu < cpu else None
    return win


def table(records: list[dict[str, Any]]) -> str:
    gpu = any("e2e_ms" in r["metrics"] for r in records)
    cols = ("cpu_ms", *GPU_COLUMNS) if gpu else ("cpu_ms",)
    rows = [
        [r["config"]["shape"], r["config"]["dtype"], *(median_of(r, c) for c in cols)]
        for r in records
    ]
    text = markdown_table(["shape", "dtype", *(c.replace("_ms", " ms") for c in cols)], rows)
    if gpu:
        dtypes = sorted({r["config"]["dtype"] for r in records})
        cols = ("kernel_ms", "e2e_pinned_ms", "e2e_ms")
        wins = [
            [c.replace("_ms", ""), *(wins_from(records, d, c) or "never" for d in dtypes)]
            for c in cols
        ]
        text += (
            "\n\nThe smallest square n (n×n @ n×n) from which the GPU is faster, counting "
            "the kernel alone, the kernel with pinned copies, and with pageable copies:\n\n"
            + markdown_table(["GPU time", *dtypes], wins)
        )
    return text


def plot(records: list[dict[str, Any]], ax: Any) -> None:
    for dtype in sorted({r["config"]["dtype"] for r in records}):
        sq = squares(records, dtype)
        n = [r["config"]["n"] for r in sq]
        for col, style in (("cpu_ms", "o-"), ("e2e_ms", "s--"), ("e2e_pinned_ms", "^:")):
            ys = [median_of(r, col) for r in sq]
            if all(y is not None for y in ys) and ys:
                ax.plot(n, ys, style, label=f"{col.replace('_ms', '')} {dtype}")
    ax.set(
        xscale="log", yscale="log", xlabel="n (n×n @ n×n)", ylabel="ms", title="matmul crossover"
    )
    ax.legend(fontsize=8)
