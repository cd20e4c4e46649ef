"""bench/matmul_crossover.py: runs end to end, writes its files, and degrades without a GPU.

The GPU code path cannot run on CI machines, so one test puts a small NumPy-backed
stand-in for ``cupy``/``cupyx`` on PYTHONPATH: it checks the script's plumbing
(every GPU column filled, crossover computed, result checked against the CPU),
not CUDA itself. The stand-in mirrors the real signatures the script relies on
(``ndarray.set(arr, stream=None)``, ``ndarray.get(stream=None, order='C',
out=None, blocking=True)``, ``Event.record(stream=None)``, ...), and rejects
anything else.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "matmul_crossover.py"
TINY = ["--max-n", "64", "--repeats", "2", "--shapes", "small"]
SKIP_PREFIX = "GPU columns skipped: "
GPU_COLS = [
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
]

FAKE_CUPY = '''
"""NumPy stand-in for the slice of CuPy that bench/matmul_crossover.py uses."""
import os
import time
import types

import numpy as np

__version__ = "0.0+fake"


class ndarray:
    def __init__(self, a):
        self._a = a

    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)

    def __matmul__(self, other):
        assert isinstance(other, ndarray), "host array mixed into a device product"
        return ndarray(self._a @ other._a)

    def set(self, arr, stream=None):
        assert isinstance(arr, np.ndarray)
        assert arr.dtype == self.dtype and arr.shape == self.shape
        self._a[...] = arr

    def get(self, stream=None, order="C", out=None, blocking=True):
        if out is None:
            return self._a.copy()
        assert out.dtype == self.dtype and out.shape == self.shape
        out[...] = self._a
        return out


def asarray(a, dtype=None, order=None, *, blocking=False):
    assert isinstance(a, np.ndarray)
    return ndarray(np.array(a, dtype=dtype, copy=True))


def empty(shape, dtype=float, order="C"):
    return ndarray(np.empty(shape, dtype=dtype, order=order))


class _Pool:
    def free_all_blocks(self):
        pass


_pool, _pinned_pool = _Pool(), _Pool()
get_default_memory_pool = lambda: _pool
get_default_pinned_memory_pool = lambda: _pinned_pool


class Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        assert self.t is not None, "synchronize() on an event never recorded"


def get_elapsed_time(start, end):
    assert start.t is not None and end.t is not None
    return (end.t - start.t) * 1e3


class _Sync:
    id = 0

    def synchronize(self):
        pass


def _device_count():
    if os.environ.get("FAKE_CUPY_NO_DEVICE"):
        raise RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")
    return 1


runtime = types.SimpleNamespace(
    getDeviceCount=_device_count,
    getDeviceProperties=lambda dev: {"name": b"Fake GPU"},
    memGetInfo=lambda: (70 * 2**30, 80 * 2**30),
    runtimeGetVersion=lambda: 12000,
    driverGetVersion=lambda: 12000,
    CUDARuntimeError=RuntimeError,
)
cuda = types.SimpleNamespace(
    Event=Event,
    get_elapsed_time=get_elapsed_time,
    Device=lambda device=None: _Sync(),
    get_current_stream=lambda: _Sync(),
    runtime=runtime,
    memory=types.SimpleNamespace(OutOfMemoryError=MemoryError),
)
'''

FAKE_CUPYX = """
import numpy as np


def empty_pinned(shape, dtype=float, order="C"):
    return np.empty(shape, dtype=dtype, order=order)
"""


def run_bench(
    args: list[str], tmp_path: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run the script as a user would, writing into ``tmp_path``."""
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def skip_lines(stdout: str) -> list[str]:
    return [ln for ln in stdout.splitlines() if ln.startswith(SKIP_PREFIX)]


def check_outputs(tmp_path: Path, n_rows: int) -> tuple[list[dict[str, str]], dict]:
    """CSV, JSON and PNG exist, agree on columns, and hold positive CPU times."""
    csv_path = tmp_path / "matmul_crossover.csv"
    json_path = tmp_path / "matmul_crossover.json"
    png_path = tmp_path / "matmul_crossover.png"
    rows = read_csv(csv_path)
    data = json.loads(json_path.read_text())
    assert list(rows[0].keys()) == data["columns"]
    for col in ("shape", "n", "k", "m", "dtype", "cpu_ms", "cpu_gflops", *GPU_COLS):
        assert col in data["columns"]
    assert len(rows) == len(data["rows"]) == n_rows
    assert all(float(r["cpu_ms"]) > 0 and float(r["cpu_gflops"]) > 0 for r in rows)
    assert data["cpu"]["blas"], "BLAS thread info missing"
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png_path.stat().st_size > 1000
    return rows, data


def test_cpu_only_run_skips_gpu_with_one_line(tmp_path: Path) -> None:
    res = run_bench(TINY, tmp_path)
    assert res.returncode == 0, res.stderr
    lines = skip_lines(res.stdout)
    if importlib.util.find_spec("cupy") is None:
        assert lines == ["GPU columns skipped: CuPy is not installed"], res.stdout
    else:  # a CUDA machine: either the device works or the one line says why not
        assert len(lines) == 1 or "\nGPU: " in res.stdout, res.stdout
    # 16, 32, 64 squares + the blog's 120x30@30x20, for two dtypes
    rows, data = check_outputs(tmp_path, n_rows=8)
    if lines:
        assert all(r[c] == "" for r in rows for c in GPU_COLS)
        assert data["gpu"]["available"] is False and data["crossover"] is None
    assert {r["shape"] for r in rows} >= {"64x64@64x64", "120x30@30x20"}
    assert {r["dtype"] for r in rows} == {"float32", "float64"}


def test_fake_gpu_path_fills_every_column(tmp_path: Path) -> None:
    fake = tmp_path / "fake"
    (fake / "cupy").mkdir(parents=True)
    (fake / "cupyx").mkdir()
    (fake / "cupy" / "__init__.py").write_text(textwrap.dedent(FAKE_CUPY))
    (fake / "cupyx" / "__init__.py").write_text(textwrap.dedent(FAKE_CUPYX))
    out = tmp_path / "out"
    res = run_bench(TINY + ["--dtype", "float32"], out, env={"PYTHONPATH": str(fake)})
    assert res.returncode == 0, res.stderr
    assert skip_lines(res.stdout) == []
    assert "GPU: Fake GPU" in res.stdout
    assert "float32: end-to-end (pageable)" in res.stdout
    rows, data = check_outputs(out, n_rows=4)
    for r in rows:
        assert all(float(r[c]) > 0 for c in GPU_COLS), r
        assert float(r["gpu_rel_err"]) < 1e-6
    assert set(data["crossover"]["float32"]) == {"e2e_pageable_ms", "e2e_pinned_ms", "kernel_ms"}

    res = run_bench(
        TINY, tmp_path / "nodev", env={"PYTHONPATH": str(fake), "FAKE_CUPY_NO_DEVICE": "1"}
    )
    assert res.returncode == 0, res.stderr
    assert skip_lines(res.stdout) == [
        "GPU columns skipped: no CUDA device: cudaErrorNoDevice: no CUDA-capable device is detected"
    ]


def test_cpu_budget_skips_big_shapes(tmp_path: Path) -> None:
    args = ["--shapes", "16x16x16,512x512x512", "--dtype", "float64", "--repeats", "1"]
    res = run_bench([*args, "--cpu-budget", "0", "--no-gpu"], tmp_path)
    assert res.returncode == 0, res.stderr
    assert skip_lines(res.stdout) == ["GPU columns skipped: --no-gpu given"]
    rows = read_csv(tmp_path / "matmul_crossover.csv")
    assert float(rows[0]["cpu_ms"]) > 0  # nothing to extrapolate from yet: measured
    assert rows[1]["cpu_ms"] == "" and "CPU skipped" in rows[1]["note"]


@pytest.fixture(scope="module")
def bench_module():
    """The script imported as a module, for its pure helpers."""
    spec = importlib.util.spec_from_file_location("matmul_crossover", SCRIPT)
    assert spec and spec.loader
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up there
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    yield mod
    sys.modules.pop(spec.name, None)


def test_crossover_requires_gpu_to_stay_ahead(bench_module) -> None:
    def row(n: int, cpu: float, gpu: float) -> dict:
        return {"kind": "square", "dtype": "float32", "n": n, "cpu_ms": cpu, "kernel_ms": gpu}

    # a noisy win at 32, a loss at 64, then wins from 128 on
    rows = [row(16, 1, 2), row(32, 1, 0.5), row(64, 1, 2), row(128, 5, 1), row(256, 9, 1)]
    c = bench_module.crossover(rows, "float32", "kernel_ms")
    assert c == {"n": 128, "first_win_n": 32, "max_n_compared": 256}
    never = bench_module.crossover(rows[:1], "float32", "kernel_ms")
    assert never["n"] is None and never["max_n_compared"] == 16


def test_shape_presets(bench_module) -> None:
    square = bench_module.parse_shapes("square", 16, 8192)
    assert [s.n for s in square] == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
    labels = {s.label for s in bench_module.parse_shapes("all", 16, 64)}
    for want in ("120x30@30x20", "60000x784@784x512", "128x784@784x512", "4096x30@30x4096"):
        assert want in labels
    custom = bench_module.parse_shapes("2x3x4,8x8x8", 16, 64)
    assert [(s.n, s.k, s.m, s.kind) for s in custom] == [(2, 3, 4, "rect"), (8, 8, 8, "square")]
