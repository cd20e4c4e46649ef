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

from bench.core import markdown_table, record, spread
from bench.flags import choice_list, int_list, positive_float, positive_int

NAME = "crossover"
SUMMARY = "CPU vs GPU matmul time, copies counted; where the GPU starts to win"
QUICK = {"sizes": [16, 32, 64, 128, 256], "repeats": 3, "extra": False, "sample_ms": 2.0}
EXTRA = ((120, 30, 20), (128, 784, 512), (60000, 784, 512))
# n×n @ n×n from 16 to 4096, a factor of about √2 apart: a crossing is placed within one step
SIZES = [16, 23, 32, 45, 64, 91, 128, 181, 256, 362, 512, 724, 1024, 1448, 2048, 2896, 4096]
DTYPES = ("float16", "float32", "float64")
GPU_COLUMNS = ("h2d_ms", "kernel_ms", "d2h_ms", "e2e_ms", "h2d_pinned_ms", "d2h_pinned_ms")
GPU_COLUMNS += ("e2e_pinned_ms",)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", type=int_list, default=SIZES, help="square sizes n (n×n @ n×n)")
    p.add_argument("--dtypes", type=choice_list(DTYPES), default=["float32", "float64"])
    p.add_argument("--repeats", type=positive_int, default=5, help="timed samples per side")
    p.add_argument(
        "--sample-ms", type=positive_float, default=20.0,
        help="each sample repeats the call until it lasts this long (the time per call kept)",
    )  # fmt: skip
    p.add_argument("--no-extra", dest="extra", action="store_false", help="square sizes only")
    p.add_argument("--no-gpu", action="store_true", help="time the CPU only")


class Timer:
    """Per-call milliseconds of one side, a sample at a time: each sample loops the call for
    about ``sample_ms`` (a 16×16 product takes microseconds, below the clock's resolution)."""

    def __init__(self, fn: Callable[[], object], sync: Callable[[], None], sample_ms: float):
        self.fn, self.sync = fn, sync
        fn()
        sync()  # warm-up: BLAS threads, cuBLAS handles and memory pools settle
        t0 = time.perf_counter()
        fn()
        sync()
        once = max(1e-6, (time.perf_counter() - t0) * 1e3)
        self.calls = max(1, min(10_000, round(sample_ms / once)))

    def sample(self) -> float:
        t0 = time.perf_counter()
        for _ in range(self.calls):
            self.fn()
        self.sync()
        return (time.perf_counter() - t0) * 1e3 / self.calls


class KernelTimer:
    """The device kernel alone, timed by CUDA events."""

    def __init__(self, cp: Any, da: Any, db: Any):
        self.cp, self.da, self.db = cp, da, db
        self.calls = 1

    def sample(self) -> float:
        start, stop = self.cp.cuda.Event(), self.cp.cuda.Event()
        start.record()
        self.da @ self.db
        stop.record()
        stop.synchronize()
        return float(self.cp.cuda.get_elapsed_time(start, stop))


def _alternated(timers: dict[str, Any], repeats: int) -> dict[str, list[float]]:
    """``repeats`` samples of every side, the order reversed each round: a drift of the
    machine's speed (another job, the clock) falls on every side alike."""
    out: dict[str, list[float]] = {k: [] for k in timers}
    names = list(timers)
    for i in range(repeats):
        for name in names if i % 2 == 0 else names[::-1]:
            out[name].append(timers[name].sample())
    return out


def _pinned(cp: Any, x: np.ndarray) -> np.ndarray:
    """A page-locked copy of ``x``: the copies to and from it run at the link's full speed."""
    mem = cp.cuda.alloc_pinned_memory(max(1, x.nbytes))
    out = np.frombuffer(mem, x.dtype, x.size).reshape(x.shape)
    out[...] = x
    return out


def _gpu_timers(cp: Any, a: np.ndarray, b: np.ndarray, ms: float) -> dict[str, Any]:
    sync = cp.cuda.Device().synchronize
    da, db = cp.asarray(a), cp.asarray(b)
    dc = da @ db
    c = np.empty(dc.shape, dc.dtype)
    pin_a, pin_b, pin_c = (_pinned(cp, x) for x in (a, b, c))
    return {
        "h2d_ms": Timer(lambda: (cp.asarray(a), cp.asarray(b)), sync, ms),
        "d2h_ms": Timer(lambda: cp.asnumpy(dc), sync, ms),
        "e2e_ms": Timer(lambda: cp.asnumpy(cp.asarray(a) @ cp.asarray(b)), sync, ms),
        "h2d_pinned_ms": Timer(lambda: (cp.asarray(pin_a), cp.asarray(pin_b)), sync, ms),
        "d2h_pinned_ms": Timer(lambda: dc.get(out=pin_c), sync, ms),
        "e2e_pinned_ms": Timer(
            lambda: (cp.asarray(pin_a) @ cp.asarray(pin_b)).get(out=pin_c), sync, ms
        ),
        "kernel_ms": KernelTimer(cp, da, db),
    }


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
    for dtype in args.dtypes:
        for m, k, n in shapes:
            a = rng.standard_normal((m, k)).astype(dtype)
            b = rng.standard_normal((k, n)).astype(dtype)
            timers = {"cpu_ms": Timer(lambda a=a, b=b: a @ b, lambda: None, args.sample_ms)}
            if cp is not None:
                timers |= _gpu_timers(cp, a, b, args.sample_ms)
            samples = _alternated(timers, args.repeats)
            config = {"m": m, "k": k, "n": n, "shape": f"{m}×{k} @ {k}×{n}", "dtype": dtype}
            info = {"gpu_skipped": why, "calls_per_sample": {k: t.calls for k, t in timers.items()}}
            out.append(record(NAME, config, samples, machine, info))
    return out


def squares(records: list[dict[str, Any]], dtype: str) -> list[dict[str, Any]]:
    """The square products of one dtype, smallest first."""
    sq = [r for r in records if r["config"]["dtype"] == dtype]
    sq = [r for r in sq if r["config"]["m"] == r["config"]["k"] == r["config"]["n"]]
    return sorted(sq, key=lambda r: r["config"]["n"])


def _range(r: dict[str, Any], column: str) -> tuple[float, float, float] | None:
    m = r["metrics"].get(column)
    return None if m is None else (m["min"], m["median"], m["max"])


def crossing(records: list[dict[str, Any]], dtype: str, column: str) -> dict[str, Any] | None:
    """Where the GPU (``column``) starts to beat the CPU on square products: ``n`` by log-log
    interpolation of the medians' ratio across 1, from the last size the GPU lost to the
    size from which it stays ahead; ``low``–``high`` the sizes between the last where the GPU
    lost in every repeat (its fastest slower than the CPU's slowest) and the first where it
    won in every repeat. None: no GPU column; ``n`` None: the GPU never stays ahead."""
    import math

    sq = [
        (r["config"]["n"], _range(r, "cpu_ms"), _range(r, column)) for r in squares(records, dtype)
    ]
    if not sq or any(g is None for _, _, g in sq):
        return None
    wins = [g[1] < c[1] for _, c, g in sq]
    first = next((i for i in range(len(sq)) if all(wins[i:])), None)
    if first is None:
        return {"n": None, "low": sq[-1][0], "high": None}
    if first == 0:
        return {"n": sq[0][0], "low": None, "high": sq[0][0]}
    (n0, c0, g0), (n1, c1, g1) = sq[first - 1], sq[first]
    r0, r1 = math.log(g0[1] / c0[1]), math.log(g1[1] / c1[1])  # > 0 lost, <= 0 won
    frac = r0 / (r0 - r1) if r0 != r1 else 0.5
    n = math.exp(math.log(n0) + frac * (math.log(n1) - math.log(n0)))
    lost = [s for s, c, g in sq[:first] if g[0] > c[2]]
    won = [s for s, c, g in sq[first:] if g[2] < c[0]]
    return {"n": round(n), "low": max(lost) if lost else None, "high": min(won) if won else None}


def crossing_text(x: dict[str, Any] | None) -> str:
    if x is None:
        return "–"
    if x["n"] is None:
        return f"never (up to {x['low']})"
    low = x["low"] if x["low"] is not None else "below the sizes"
    high = x["high"] if x["high"] is not None else "above the sizes"
    return f"≈{x['n']} (between {low} and {high})"


def table(records: list[dict[str, Any]]) -> str:
    gpu = any("e2e_ms" in r["metrics"] for r in records)
    cols = ("cpu_ms", *GPU_COLUMNS) if gpu else ("cpu_ms",)
    rows = [
        [r["config"]["shape"], r["config"]["dtype"], *(spread(r, c) for c in cols)] for r in records
    ]
    heads = ["shape", "dtype", *(c.replace("_ms", " ms") for c in cols)]
    text = (
        "Time per product, median (min–max, n = samples); each sample loops the call for "
        "a fixed time; the sides alternate.\n\n" + markdown_table(heads, rows)
    )
    if not gpu:
        return text + "\n\nNo GPU found: the CPU's times alone, no crossing to find."
    dtypes = sorted({r["config"]["dtype"] for r in records})
    cols = ("kernel_ms", "e2e_pinned_ms", "e2e_ms")
    wins = [
        [c.replace("_ms", ""), *(crossing_text(crossing(records, d, c)) for d in dtypes)]
        for c in cols
    ]
    return text + (
        "\n\nThe square n (n×n @ n×n) from which the GPU is faster, counting the kernel "
        "alone, the kernel with pinned copies, and with pageable copies; interpolated between "
        "the sizes measured, with the sizes between which the repeats leave it:\n\n"
        + markdown_table(["GPU time", *dtypes], wins)
    )


def plot(records: list[dict[str, Any]], ax: Any) -> None:
    gpu = any("e2e_ms" in r["metrics"] for r in records)
    for dtype in sorted({r["config"]["dtype"] for r in records}):
        sq = squares(records, dtype)
        n = [r["config"]["n"] for r in sq]
        for col, style in (("cpu_ms", "o-"), ("e2e_ms", "s--"), ("e2e_pinned_ms", "^:")):
            got = [_range(r, col) for r in sq]
            if got and all(g is not None for g in got):
                med = [g[1] for g in got]
                err = [[g[1] - g[0] for g in got], [g[2] - g[1] for g in got]]
                ax.errorbar(n, med, yerr=err, fmt=style, ms=4, capsize=2,
                            label=f"{col.replace('_ms', '')} {dtype}")  # fmt: skip
        x = crossing(records, dtype, "e2e_ms") if gpu else None
        if x and x["n"]:
            ax.axvline(x["n"], color="grey", lw=0.8, ls=":")
    reps = max((r["repeats"] for r in records), default=0)
    title = (
        "matmul: where the GPU overtakes the CPU" if gpu
        else "CPU matmul time against size (no GPU found)"
    )  # fmt: skip
    ax.set(xscale="log", yscale="log", xlabel="n (n×n @ n×n)", ylabel="time per product (ms)",
           title=f"{title}\nmedian, bars min–max of {reps} samples")  # fmt: skip
    ax.legend(fontsize=8)
