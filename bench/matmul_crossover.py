"""Where does a GPU start beating the CPU at one matrix product, copies included?

A blog post (DT42, 2016) saw a GPU lose to the CPU on a 120x30 @ 30x20 product
and blamed the host<->device copies. This script does that experiment properly:
for (n x k) @ (k x m) over a square sweep (n = k = m = 16 ... --max-n) and a few
rectangular shapes taken from xpnn's own workloads, it times *separately*

* the CPU product with NumPy (BLAS thread count recorded; ``--threads`` sets it);
* the host->device copy of both inputs, the GPU kernel alone, the device->host
  copy of the result (CUDA events, on the current stream), and the whole
  round trip copy in + kernel + copy out (synchronised wall clock);
* the copies and the round trip twice: from ordinary (pageable) NumPy memory,
  and from page-locked (pinned) host buffers made with ``cupyx.empty_pinned``.

Every figure is the median of ``--repeats`` runs after untimed warm-up runs.
Separate columns matter because "the GPU is slow" can mean three different
things: the kernel is slow (it rarely is), the copies dominate (small shapes),
or pageable memory halves the copy bandwidth (fixable with pinned buffers).

Without CuPy or without a CUDA device the GPU columns are skipped with one line
saying why, and the CPU columns, table, CSV, JSON and plot are still produced.

Run: ``python bench/matmul_crossover.py --help``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from _common import (
    RESULTS_DIR,
    Parser,
    blas_info,
    blas_threads,
    busy_warning,
    can_plot,
    fmt_num,
    format_table,
    machine_info,
    median,
    nonneg_float,
    nonneg_int,
    out_path,
    plot_path,
    positive_int,
    pyplot_agg,
    refuse_unwritable,
    run_main,
    save_figure,
    time_wall,
    write_csv,
    write_json,
)

NAME = "matmul_crossover"
DTYPES = ("float32", "float64")
MAX_N_CPU_ONLY = 4096  # keeps a CPU-only run to about a minute on a laptop
MAX_N_GPU = 8192
GPU_WARMUP_MIN = 3  # cuBLAS handle/heuristics and CuPy's pinned staging pool settle here
GPU_MEM_FRACTION = 0.8  # leave headroom for cuBLAS workspace and the pools
CPU_MIN_SAMPLE_S = 1e-3  # shorter CPU calls are timed in batches (timer noise)

# (n, k, m): the blog's shape, one MNIST-sized layer over the whole training set
# and over a 128 minibatch, and a rank-30 outer-product-like shape (big output,
# tiny k: copy-bound on any GPU).
RECT_SHAPES: tuple[tuple[int, int, int], ...] = (
    (120, 30, 20),
    (60000, 784, 512),
    (128, 784, 512),
    (4096, 30, 4096),
)
BLOG_SHAPE = (120, 30, 20)
SHAPE_PRESETS = ("all", "square", "rect", "small")

COLUMNS: tuple[str, ...] = (
    "shape",
    "kind",
    "n",
    "k",
    "m",
    "dtype",
    "gflop",
    "cpu_ms",
    "cpu_gflops",
    "h2d_pageable_ms",
    "kernel_ms",
    "d2h_pageable_ms",
    "e2e_pageable_ms",
    "h2d_pinned_ms",
    "d2h_pinned_ms",
    "e2e_pinned_ms",
    "gpu_gflops",
    "speedup_e2e_pageable",
    "speedup_e2e_pinned",
    "speedup_kernel",
    "gpu_rel_err",
    "note",
)
GPU_COLUMNS = COLUMNS[COLUMNS.index("h2d_pageable_ms") : COLUMNS.index("gpu_rel_err") + 1]


@dataclass(frozen=True)
class Shape:
    """One product (n x k) @ (k x m); ``kind`` is "square" for the sweep, else "rect"."""

    n: int
    k: int
    m: int
    kind: str

    @property
    def label(self) -> str:
        return f"{self.n}x{self.k}@{self.k}x{self.m}"

    @property
    def flop(self) -> float:
        """Multiply-adds counted as two flops, the usual GEMM convention."""
        return 2.0 * self.n * self.k * self.m


# --------------------------------------------------------------------------- shapes


def square_sweep(min_n: int, max_n: int) -> list[Shape]:
    """Powers of two from ``min_n`` to ``max_n`` inclusive: even spacing on a log plot."""
    out, n = [], min_n
    while n <= max_n:
        out.append(Shape(n, n, n, "square"))
        n *= 2
    return out


def parse_shapes(spec: str, min_n: int, max_n: int) -> list[Shape]:
    """A preset name (all, square, rect, small) or a comma list of ``NxKxM``.

    ``small`` is the square sweep plus the blog's 120x30@30x20: the cheap preset
    for smoke tests.
    """
    square = square_sweep(min_n, max_n)
    rect = [Shape(*s, "rect") for s in RECT_SHAPES]
    if spec == "all":
        return square + rect
    if spec == "square":
        return square
    if spec == "rect":
        return rect
    if spec == "small":
        return square + [Shape(*BLOG_SHAPE, "rect")]
    shapes = []
    for item in spec.split(","):
        try:
            n, k, m = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"bad shape {item!r}: use a preset {SHAPE_PRESETS} or NxKxM[,NxKxM...]"
            ) from None
        if min(n, k, m) < 1:
            raise argparse.ArgumentTypeError(f"bad shape {item!r}: sizes must be positive")
        if any((s.n, s.k, s.m) == (n, k, m) for s in shapes):
            raise argparse.ArgumentTypeError(f"shape {item!r} given twice in {spec!r}")
        shapes.append(Shape(n, k, m, "square" if n == k == m else "rect"))
    return shapes


def shape_spec(text: str) -> str:
    """``--shapes``: a preset, or an ``NxKxM`` list that parses (a usage error otherwise)."""
    if text not in SHAPE_PRESETS:
        parse_shapes(text, 1, 1)  # raises ArgumentTypeError, which argparse names the flag in
    return text


# --------------------------------------------------------------------------- CPU


def measure_cpu(a: np.ndarray, b: np.ndarray, repeats: int, warmup: int) -> tuple[float, Any]:
    """Median ms of ``a @ b`` with NumPy, and the product (the GPU's reference answer).

    ``a @ b`` (allocating the result) is what user code writes; at the sizes
    where allocation could show, BLAS time dwarfs it. Calls shorter than
    ``CPU_MIN_SAMPLE_S`` are timed in batches (see ``time_wall``).
    """
    samples = time_wall(lambda: a @ b, repeats, max(warmup, 1), CPU_MIN_SAMPLE_S)
    return median(samples) * 1e3, a @ b


class CpuBudget:
    """Predicts CPU time from the rate measured on smaller shapes and skips what won't fit.

    The rate of the largest already-measured shape with no more flops than the
    new one is used: BLAS gets faster with size, so the estimate errs long and
    a skipped shape really would have been slow.
    """

    def __init__(self, budget_s: float, runs: int) -> None:
        self.budget_s = budget_s
        self.runs = runs
        self.rates: dict[str, list[tuple[float, float]]] = {}  # dtype -> (flop, flop/s)

    def estimate_s(self, shape: Shape, dtype: str) -> float | None:
        seen = sorted(self.rates.get(dtype, []))
        if not seen:
            return None
        smaller = [rate for flop, rate in seen if flop <= shape.flop]
        rate = smaller[-1] if smaller else seen[0][1]
        return shape.flop / rate * self.runs

    def allows(self, shape: Shape, dtype: str) -> tuple[bool, float | None]:
        est = self.estimate_s(shape, dtype)
        return (est is None or est <= self.budget_s), est

    def record(self, shape: Shape, dtype: str, ms: float) -> None:
        if ms > 0:
            self.rates.setdefault(dtype, []).append((shape.flop, shape.flop / (ms * 1e-3)))


# --------------------------------------------------------------------------- GPU


def load_cupy(disabled: bool = False) -> tuple[Any, Any, str | None]:
    """``(cupy, cupyx, None)`` when a CUDA device is usable, else ``(None, None, reason)``.

    Imported here, not at module level, so the script runs on machines without
    CuPy; the device probe is wrapped because CuPy imports fine with no driver.
    """
    if disabled:
        return None, None, "--no-gpu given"
    try:
        import cupy
        import cupyx
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] in ("cupy", "cupyx"):
            return None, None, "CuPy is not installed"
        return None, None, f"CuPy failed to import: {exc}"
    except Exception as exc:  # CUDA libraries missing/mismatched surface here
        return None, None, f"CuPy failed to import: {exc}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return None, None, f"no CUDA device: {exc}"
    if count < 1:
        return None, None, "no CUDA device: getDeviceCount() returned 0"
    return cupy, cupyx, None


def gpu_info(cp: Any) -> dict[str, Any]:
    """Device name, memory and library versions, for the JSON record."""
    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    name = props.get("name", b"?")
    _, total = cp.cuda.runtime.memGetInfo()
    return {
        "name": name.decode() if isinstance(name, bytes) else str(name),
        "device_id": dev.id,
        "memory_gib": round(total / 2**30, 1),
        "cupy": getattr(cp, "__version__", "?"),
        "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
        "cuda_driver": cp.cuda.runtime.driverGetVersion(),
    }


def free_gpu_memory(cp: Any) -> None:
    """Return cached blocks to the driver so one size's pools don't starve the next."""
    cp.get_default_memory_pool().free_all_blocks()
    cp.get_default_pinned_memory_pool().free_all_blocks()


def event_samples(cp: Any, fn: Callable[[], object], repeats: int, warmup: int) -> list[float]:
    """GPU-timeline ms of ``fn`` bracketed by CUDA events on the current stream.

    The device is idled first so the start event is not queued behind older
    work; ``fn``'s return value is kept alive until the end event has completed
    so its memory is not recycled while the GPU still writes it.
    """
    start, end = cp.cuda.Event(), cp.cuda.Event()
    samples = []
    for i in range(warmup + repeats):
        cp.cuda.Device().synchronize()
        start.record()
        keep = fn()
        end.record()
        end.synchronize()
        if i >= warmup:
            samples.append(cp.cuda.get_elapsed_time(start, end))
        del keep
    return samples


def wall_samples(cp: Any, fn: Callable[[], object], repeats: int, warmup: int) -> list[float]:
    """Host wall-clock ms of ``fn``, with the device synchronised before start and stop."""
    samples = []
    for i in range(warmup + repeats):
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        keep = fn()
        cp.cuda.get_current_stream().synchronize()
        cp.cuda.Device().synchronize()
        t1 = time.perf_counter()
        if i >= warmup:
            samples.append((t1 - t0) * 1e3)
        del keep
    return samples


def gpu_fits(cp: Any, shape: Shape, itemsize: int) -> tuple[bool, str]:
    """Whether two device copies of A, B and C fit in free memory, with headroom."""
    nbytes = (shape.n * shape.k + shape.k * shape.m + shape.n * shape.m) * itemsize
    free, _ = cp.cuda.runtime.memGetInfo()
    need = 3 * nbytes
    if need > GPU_MEM_FRACTION * free:
        return False, f"needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free on GPU"
    return True, ""


def measure_gpu(
    cp: Any, cpx: Any, a: np.ndarray, b: np.ndarray, repeats: int, warmup: int
) -> tuple[dict[str, float], np.ndarray]:
    """All GPU columns for one shape (ms medians) and the GPU's product.

    Pageable path: ``cupy.asarray`` from ordinary NumPy memory (CuPy stages it
    through its pinned pool with a host memcpy first: that cost is the point)
    and ``.get()`` into a fresh NumPy array. Pinned path: inputs already live in
    ``cupyx.empty_pinned`` buffers, copied with ``ndarray.set`` (an async DMA on
    the current stream) and back with ``.get(out=pinned)``; allocating the
    pinned buffers is a one-off cost kept out of the timings.

    Event times run from the start event to the end event on the GPU, so at
    tiny sizes the kernel column includes CuPy's host-side dispatch (the GPU
    idles while ``a @ b`` is launched): that is the latency a caller sees.
    """
    warmup = max(warmup, GPU_WARMUP_MIN)
    dtype = a.dtype
    c_shape = (a.shape[0], b.shape[1])

    pa = cpx.empty_pinned(a.shape, dtype=dtype)
    pb = cpx.empty_pinned(b.shape, dtype=dtype)
    pc = cpx.empty_pinned(c_shape, dtype=dtype)
    pa[...] = a
    pb[...] = b

    d_a = cp.asarray(a)
    d_b = cp.asarray(b)
    d_c = d_a @ d_b
    cp.cuda.Device().synchronize()

    def h2d_pageable() -> object:
        return cp.asarray(a), cp.asarray(b)

    def h2d_pinned() -> object:
        d_a.set(pa)
        d_b.set(pb)
        return None

    def kernel() -> object:
        return d_a @ d_b

    def d2h_pageable() -> object:
        # blocking=False: the end event must follow the copy directly, not a host sync.
        return d_c.get(blocking=False)

    def d2h_pinned() -> object:
        return d_c.get(out=pc, blocking=False)

    def e2e_pageable() -> object:
        x = cp.asarray(a)
        y = cp.asarray(b)
        return (x @ y).get()

    def e2e_pinned() -> object:
        x = cp.empty(a.shape, dtype=dtype)
        y = cp.empty(b.shape, dtype=dtype)
        x.set(pa)
        y.set(pb)
        (x @ y).get(out=pc)
        return pc

    out = {
        "h2d_pageable_ms": median(event_samples(cp, h2d_pageable, repeats, warmup)),
        "h2d_pinned_ms": median(event_samples(cp, h2d_pinned, repeats, warmup)),
        "kernel_ms": median(event_samples(cp, kernel, repeats, warmup)),
        "d2h_pageable_ms": median(event_samples(cp, d2h_pageable, repeats, warmup)),
        "d2h_pinned_ms": median(event_samples(cp, d2h_pinned, repeats, warmup)),
        "e2e_pageable_ms": median(wall_samples(cp, e2e_pageable, repeats, warmup)),
        "e2e_pinned_ms": median(wall_samples(cp, e2e_pinned, repeats, warmup)),
    }
    return out, (d_a @ d_b).get()  # device and pinned buffers die with this frame


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    """Relative Frobenius error: catches a wrong GPU path without flagging rounding."""
    scale = float(np.linalg.norm(ref))
    diff = float(np.linalg.norm(got.astype(np.float64) - ref.astype(np.float64)))
    return diff / scale if scale else diff


# --------------------------------------------------------------------------- analysis


def ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def crossover(rows: Sequence[dict[str, Any]], dtype: str, column: str) -> dict[str, Any]:
    """Smallest square n from which the GPU (``column``) beats the CPU at every larger n.

    "Every larger n" rather than "first win" so one noisy small-size win does
    not pass for a crossover. ``n`` is None when the GPU never stays ahead.
    """
    sq = sorted(
        (
            r
            for r in rows
            if r["kind"] == "square"
            and r["dtype"] == dtype
            and r.get("cpu_ms") is not None
            and r.get(column) is not None
        ),
        key=lambda r: r["n"],
    )
    n = None
    for r in reversed(sq):
        if r[column] < r["cpu_ms"]:
            n = r["n"]
        else:
            break
    first = next((r["n"] for r in sq if r[column] < r["cpu_ms"]), None)
    return {"n": n, "first_win_n": first, "max_n_compared": sq[-1]["n"] if sq else None}


def crossover_lines(crossovers: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    names = {
        "e2e_pageable_ms": "end-to-end (pageable)",
        "e2e_pinned_ms": "end-to-end (pinned)",
        "kernel_ms": "kernel only",
    }
    lines = ["Crossover (square n x n @ n x n; GPU faster than CPU from this n up):"]
    for dtype, by_col in crossovers.items():
        parts = []
        for col, c in by_col.items():
            if c["max_n_compared"] is None:
                parts.append(f"{names[col]}: not measured")
            elif c["n"] is None:
                parts.append(f"{names[col]}: CPU wins up to n={c['max_n_compared']}")
            else:
                parts.append(f"{names[col]}: n={c['n']}")
        lines.append(f"  {dtype}: " + "; ".join(parts))
    return lines


# --------------------------------------------------------------------------- output

TABLE_CPU = [("shape", "shape"), ("dtype", "dtype"), ("cpu_ms", "cpu ms"), ("cpu_gflops", "GF/s")]
TABLE_GPU = [
    ("h2d_pageable_ms", "h2d ms"),
    ("kernel_ms", "kernel ms"),
    ("d2h_pageable_ms", "d2h ms"),
    ("e2e_pageable_ms", "e2e ms"),
    ("h2d_pinned_ms", "h2d pin"),
    ("d2h_pinned_ms", "d2h pin"),
    ("e2e_pinned_ms", "e2e pin"),
    ("gpu_gflops", "gpu GF/s"),
    ("speedup_e2e_pageable", "x e2e"),
    ("speedup_e2e_pinned", "x e2e pin"),
    ("speedup_kernel", "x kernel"),
]


def render_table(rows: Sequence[dict[str, Any]], with_gpu: bool) -> str:
    """The console table; GPU columns are left out entirely when they were skipped."""
    cols = TABLE_CPU + (TABLE_GPU if with_gpu else [])
    show_note = any(r.get("note") for r in rows)
    headers = [h for _, h in cols] + (["note"] if show_note else [])
    body = []
    for r in rows:
        cells = [v if isinstance(v := r.get(key), str) else fmt_num(v) for key, _ in cols]
        if show_note:
            cells.append(r.get("note") or "")
        body.append(cells)
    return format_table(headers, body)


def plot(rows: Sequence[dict[str, Any]], dtypes: Sequence[str], path: Path, title: str) -> None:
    """Log-log ms vs n for the square sweep, one panel per dtype."""
    plt = pyplot_agg()
    series = [
        ("cpu_ms", "CPU (NumPy)", "k", "-"),
        ("kernel_ms", "GPU kernel", "tab:green", "-"),
        ("h2d_pageable_ms", "H2D pageable", "tab:blue", "--"),
        ("h2d_pinned_ms", "H2D pinned", "tab:blue", ":"),
        ("d2h_pageable_ms", "D2H pageable", "tab:purple", "--"),
        ("d2h_pinned_ms", "D2H pinned", "tab:purple", ":"),
        ("e2e_pageable_ms", "GPU end-to-end pageable", "tab:red", "-"),
        ("e2e_pinned_ms", "GPU end-to-end pinned", "tab:orange", "-"),
    ]
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6.5 * len(dtypes), 5), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes, strict=True):
        sq = sorted(
            (r for r in rows if r["kind"] == "square" and r["dtype"] == dtype),
            key=lambda r: r["n"],
        )
        for key, label, color, style in series:
            pts = [(r["n"], r[key]) for r in sq if r.get(key) is not None]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, style, color=color, marker="o", ms=3, label=label)
        ax.set_xscale("log", base=2)
        if sq:
            ax.set_xticks([r["n"] for r in sq], [str(r["n"]) for r in sq], fontsize=8)
        ax.set_yscale("log")
        ax.set_xlabel("n  (n x n @ n x n)")
        ax.set_ylabel("time [ms]")
        ax.set_title(dtype)
        ax.grid(True, which="both", alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
    save_figure(fig, path, title, dpi=120)


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        description="Time a matmul on CPU (NumPy) vs GPU (CuPy) with copies timed separately, "
        "and find the size where the GPU starts to win.",
    )
    p.add_argument(
        "--max-n",
        type=positive_int,
        default=None,
        help=f"largest square n (default {MAX_N_GPU} with a GPU, {MAX_N_CPU_ONLY} without)",
    )
    p.add_argument("--min-n", type=positive_int, default=16, help="smallest square n (default 16)")
    p.add_argument(
        "--shapes",
        type=shape_spec,
        default="all",
        help=f"preset {SHAPE_PRESETS} (small = square sweep + the blog's 120x30@30x20) "
        "or a comma list of NxKxM (default all)",
    )
    p.add_argument("--dtype", choices=(*DTYPES, "both"), default="both", help="default both")
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=5,
        help="timed runs per column, median reported (default 5)",
    )
    p.add_argument(
        "--warmup",
        type=nonneg_int,
        default=1,
        help=f"untimed runs first (default 1; the GPU uses at least {GPU_WARMUP_MIN})",
    )
    p.add_argument(
        "--threads", type=positive_int, default=None, help="BLAS threads (default: as loaded)"
    )
    p.add_argument(
        "--cpu-budget",
        type=nonneg_float,
        default=60.0,
        help="skip a CPU shape whose estimated warm-up + repeats exceed this many seconds "
        "(default 60; 0: measure only the first shape of each dtype)",
    )
    p.add_argument("--seed", type=nonneg_int, default=0, help="input data seed (default 0)")
    p.add_argument("--no-gpu", action="store_true", help="skip the GPU columns even if CuPy works")
    p.add_argument(
        "--out", type=out_path, default=RESULTS_DIR, help="output directory (default bench/results)"
    )
    p.add_argument("--csv", type=out_path, default=None, help=f"CSV file (default OUT/{NAME}.csv)")
    p.add_argument(
        "--json", type=out_path, default=None, help=f"JSON file (default OUT/{NAME}.json)"
    )
    p.add_argument("--plot", type=plot_path, default=None, help=f"plot (default OUT/{NAME}.png)")
    return p


def progress(msg: str) -> None:
    """Per-shape progress on stderr, so stdout stays the report."""
    print(msg, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    cp, cpx, skip_reason = load_cupy(args.no_gpu)
    max_n = args.max_n or (MAX_N_GPU if cp is not None else MAX_N_CPU_ONLY)
    shapes = parse_shapes(args.shapes, args.min_n, max_n)  # its syntax checked by argparse
    dtypes = DTYPES if args.dtype == "both" else (args.dtype,)
    out_dir: Path = args.out
    csv_path = args.csv or out_dir / f"{NAME}.csv"
    json_path = args.json or out_dir / f"{NAME}.json"
    png_path = args.plot or out_dir / f"{NAME}.png"

    machine = machine_info()  # before we load the CPUs ourselves
    rng = np.random.default_rng(args.seed)
    budget = CpuBudget(args.cpu_budget, args.repeats + args.warmup + 1)
    gpu = gpu_info(cp) if cp is not None else None
    rows: list[dict[str, Any]] = []

    with blas_threads(args.threads):
        blas = blas_info()
        threads = blas[0]["num_threads"] if blas else None
        blas_desc = (
            f"{blas[0]['internal_api']} {blas[0]['version']}, {threads} BLAS threads"
            if blas
            else "no BLAS found by threadpoolctl"
        )
        print(f"CPU: NumPy {np.__version__}, {blas_desc}")
        if gpu:
            print(f"GPU: {gpu['name']}, CuPy {gpu['cupy']}, CUDA runtime {gpu['cuda_runtime']}")
        else:
            print(f"GPU columns skipped: {skip_reason}")
        print(f"median of {args.repeats} runs after warm-up; times in ms, GF/s = 2nkm/t")
        if warning := busy_warning():
            print(warning)

        for dtype in dtypes:
            for shape in shapes:
                row: dict[str, Any] = {c: None for c in COLUMNS}
                row.update(
                    shape=shape.label,
                    kind=shape.kind,
                    n=shape.n,
                    k=shape.k,
                    m=shape.m,
                    dtype=dtype,
                    gflop=shape.flop / 1e9,
                )
                notes = []
                a = rng.standard_normal((shape.n, shape.k), dtype=dtype)
                b = rng.standard_normal((shape.k, shape.m), dtype=dtype)

                ref = None
                ok, est = budget.allows(shape, dtype)
                if ok:
                    ms, ref = measure_cpu(a, b, args.repeats, args.warmup)
                    budget.record(shape, dtype, ms)
                    row["cpu_ms"] = ms
                    row["cpu_gflops"] = shape.flop / (ms * 1e-3) / 1e9
                else:
                    notes.append(f"CPU skipped: ~{est:.0f} s > --cpu-budget {args.cpu_budget:g}")

                if cp is not None:
                    fits, why = gpu_fits(cp, shape, a.itemsize)
                    if not fits:
                        notes.append(f"GPU skipped: {why}")
                    else:
                        try:
                            cols, got = measure_gpu(cp, cpx, a, b, args.repeats, args.warmup)
                        except (cp.cuda.memory.OutOfMemoryError, MemoryError) as exc:
                            notes.append(f"GPU skipped: out of memory ({exc})")
                        except cp.cuda.runtime.CUDARuntimeError as exc:  # e.g. pinned alloc
                            notes.append(f"GPU skipped: CUDA error ({exc})")
                        else:
                            row.update(cols)
                            row["gpu_gflops"] = shape.flop / (cols["kernel_ms"] * 1e-3) / 1e9
                            if ref is not None:
                                row["gpu_rel_err"] = rel_err(got, ref)
                                tol = 1e-4 if dtype == "float32" else 1e-10
                                if row["gpu_rel_err"] > tol:
                                    notes.append("GPU result differs from CPU!")
                        finally:
                            free_gpu_memory(cp)

                row["speedup_e2e_pageable"] = ratio(row["cpu_ms"], row["e2e_pageable_ms"])
                row["speedup_e2e_pinned"] = ratio(row["cpu_ms"], row["e2e_pinned_ms"])
                row["speedup_kernel"] = ratio(row["cpu_ms"], row["kernel_ms"])
                row["note"] = "; ".join(notes) or None
                rows.append(row)
                progress(
                    f"  {dtype} {shape.label}: cpu {fmt_num(row['cpu_ms'])} ms"
                    + (f", gpu e2e {fmt_num(row['e2e_pageable_ms'])} ms" if cp else "")
                )
                del a, b, ref

    print()
    print(render_table(rows, with_gpu=cp is not None))
    print()
    cross_cols = ("e2e_pageable_ms", "e2e_pinned_ms", "kernel_ms")
    crossovers = {d: {c: crossover(rows, d, c) for c in cross_cols} for d in dtypes}
    if cp is not None:
        for line in crossover_lines(crossovers):
            print(line)
    else:
        print("Crossover: not measured (no GPU columns)")

    write_csv(csv_path, COLUMNS, rows)
    write_json(
        json_path,
        {
            "benchmark": NAME,
            "machine": machine,
            "cpu": {"blas": blas, "threads_requested": args.threads},
            "gpu": {"available": cp is not None, "skipped_reason": skip_reason, **(gpu or {})},
            "settings": {
                "repeats": args.repeats,
                "warmup_cpu": args.warmup,
                "warmup_gpu": max(args.warmup, GPU_WARMUP_MIN),
                "shapes": args.shapes,
                "min_n": args.min_n,
                "max_n": max_n,
                "dtypes": list(dtypes),
                "cpu_budget_s": args.cpu_budget,
                "seed": args.seed,
            },
            "columns": list(COLUMNS),
            "rows": rows,
            "crossover": crossovers if cp is not None else None,
        },
    )
    title = f"matmul CPU vs GPU: CPU {blas_desc}" + (
        f"; GPU {gpu['name']}" if gpu else f"; GPU columns skipped: {skip_reason}"
    )
    if args.draw_plot:
        plot(rows, dtypes, png_path, title)
    print(f"wrote {csv_path}, {json_path}" + (f", {png_path}" if args.draw_plot else ""))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_n is not None and args.min_n > args.max_n:
        parser.error(f"--min-n {args.min_n} is above --max-n {args.max_n}")
    files = {"--csv": args.csv, "--json": args.json, "--plot": args.plot}
    if None in files.values():  # some file goes to its default place in --out
        refuse_unwritable(parser, "--out", args.out, folder=True)
    for flag, path in files.items():
        if path is not None:
            refuse_unwritable(parser, flag, path)
    args.draw_plot = can_plot(parser, args.plot is not None)
    return run(args)


if __name__ == "__main__":
    run_main(main)
