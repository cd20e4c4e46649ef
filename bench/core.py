"""The suite's one runner, one record schema and one description of the machine.

A record is one JSON object per measured configuration, appended to a ``.jsonl`` file:

    {"schema": 1, "benchmark": "scaling", "time": "2026-11-26T08:30:00Z",
     "config": {...what was run...}, "machine": {...describe_machine()...},
     "repeats": 3, "metrics": {"epoch_s": {"median": 1.2, "min": 1.1, "max": 1.4,
     "samples": [...]}, ...}, "info": {...what the runs reported, not timed...}}

Every number a table or plot shows is read back from such records, so a plot can be redrawn
and a table rebuilt from ``bench/results/*.jsonl`` without measuring again.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

SCHEMA = 1
ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = Path(__file__).resolve().parent / "results"


class BenchError(Exception):
    """A problem the user can fix (a flag, a missing tool); printed as one line, exit 2."""


class RunFailed(RuntimeError):
    """A measured run exited non-zero; carries the tail of its output."""


# --------------------------------------------------------------------------- machine


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _blas() -> list[dict[str, Any]]:
    """Which BLAS NumPy calls and its kernel (threadpoolctl's ``architecture``)."""
    import numpy  # noqa: F401  (loads the BLAS that threadpoolctl then finds)
    from threadpoolctl import threadpool_info

    keep = ("internal_api", "version", "architecture", "num_threads", "threading_layer")
    return [{k: p.get(k) for k in keep} for p in threadpool_info() if p.get("user_api") == "blas"]


def _mpi_library() -> str | None:
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    from xpnn.runtime import library_name

    return library_name(MPI.Get_library_version())


def _gpu() -> dict[str, Any] | None:
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        props = cupy.cuda.runtime.getDeviceProperties(0)
        return {
            "name": props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
            "memory_gib": round(props["totalGlobalMem"] / 2**30, 1),
            "cupy": cupy.__version__,
        }
    except Exception:  # no CuPy, no driver or no device: the machine has no usable GPU
        return None


def describe_machine() -> dict[str, Any]:
    """CPU, cores, BLAS and its kernel, MPI library and GPU: what a number depends on."""
    import numpy

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    # what the launcher spreads the ranks over, where it is not this one machine
    setup = {"setup": os.environ["XPNN_BENCH_SETUP"]} if os.environ.get("XPNN_BENCH_SETUP") else {}
    return {
        **setup,
        "host": platform.node(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "blas": _blas(),
        "mpi": _mpi_library(),
        "gpu": _gpu(),
    }


def machine_line(m: dict[str, Any]) -> str:
    blas = ", ".join(
        f"{b['internal_api']} {b['version']} ({b['architecture']}, {b['num_threads']} threads)"
        for b in m.get("blas") or []
    )
    gpu = m.get("gpu")
    gpu_text = f"{gpu['name']} ({gpu['memory_gib']} GiB)" if gpu else "no GPU"
    return (
        f"{m.get('cpu')}, {m.get('cores')} cores ({m.get('usable_cores')} usable); "
        f"BLAS {blas or 'unknown'}; MPI {m.get('mpi') or 'none'}; {gpu_text}; "
        f"Python {m.get('python')}, NumPy {m.get('numpy')}"
        + (f"; {m['setup']}" if m.get("setup") else "")
    )


# --------------------------------------------------------------------------- records


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def stats(samples: Sequence[float]) -> dict[str, Any]:
    """Median and range of repeated measurements (the suite's one summary)."""
    xs = [float(x) for x in samples]
    if not xs:
        raise ValueError("no samples")
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "samples": xs}


def record(
    benchmark: str,
    config: dict[str, Any],
    samples: dict[str, Sequence[float]],
    machine: dict[str, Any],
    info: dict[str, Any] | None = None,
) -> dict[str, Any]:
    repeats = max((len(v) for v in samples.values()), default=0)
    return {
        "schema": SCHEMA,
        "benchmark": benchmark,
        "time": now(),
        "config": config,
        "machine": machine,
        "repeats": repeats,
        "metrics": {k: stats(v) for k, v in samples.items() if len(v)},
        "info": info or {},
    }


def write_records(path: Path, records: Iterable[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for r in records:
            f.write(json.dumps(r, sort_keys=True) + "\n")
    return path


def read_records(path: Path, benchmark: str | None = None) -> list[dict[str, Any]]:
    out = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            if r.get("schema") == SCHEMA and (benchmark is None or r["benchmark"] == benchmark):
                out.append(r)
    return out


def median_of(r: dict[str, Any], metric: str) -> float | None:
    m = r["metrics"].get(metric)
    return None if m is None else m["median"]


# --------------------------------------------------------------------------- running xpnn


def find_mpiexec() -> str:
    """``$XPNN_MPIEXEC`` (another MPI's launcher, e.g. a CUDA-aware one), else the one next to
    this Python (the mpich wheel's), else the one on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    found = os.environ.get("XPNN_MPIEXEC") or (
        str(local) if local.exists() else shutil.which("mpiexec")
    )
    if found is None:
        raise BenchError("mpiexec: not found next to this Python or on PATH (pip install mpich)")
    return found


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def run_command(cmd: Sequence[str], timeout: float | None = None) -> str:
    """Run one measured command; a failure raises RunFailed with the last lines it printed."""
    try:
        proc = subprocess.run(
            list(cmd), capture_output=True, text=True, timeout=timeout, env=_env(), check=False
        )
    except subprocess.TimeoutExpired as e:
        raise RunFailed(f"timed out after {timeout} s: {' '.join(cmd)}") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-8:])
        raise RunFailed(f"exit {proc.returncode}: {' '.join(cmd)}\n{tail}")
    return proc.stdout


def run_worker(module: str, ranks: int, args: Sequence[str], timeout: float | None) -> Any:
    """``mpiexec -n RANKS python -m MODULE OUT ARGS...``: the JSON its rank 0 wrote to OUT. A
    benchmark that needs processes of its own runs itself (its ``__main__``) this way."""
    with tempfile.TemporaryDirectory(prefix="xpnn-bench-") as tmp:
        out = Path(tmp) / "out.json"
        cmd = [find_mpiexec(), "-n", str(ranks), sys.executable, "-m", module, str(out), *args]
        run_command(cmd, timeout)
        return json.loads(out.read_text())


def xpnn_command(ranks: int, flags: Sequence[str]) -> list[str]:
    """``mpiexec -n N python -m xpnn FLAGS`` (plain ``python -m xpnn`` for ranks == 0)."""
    base = [sys.executable, "-m", "xpnn", *flags, "--no-progress"]
    return base if ranks == 0 else [find_mpiexec(), "-n", str(ranks), *base]


def run_xpnn(
    ranks: int, flags: Sequence[str], timeout: float | None = None
) -> list[dict[str, Any]]:
    """Train once through the command line; return its metrics file's records.

    The CLI and its metrics file are the stable contract (DESIGN.md), so every training
    benchmark measures through them rather than through library internals.
    """
    with tempfile.TemporaryDirectory(prefix="xpnn-bench-") as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        run_command(xpnn_command(ranks, [*flags, "--metrics", str(metrics)]), timeout)
        return [json.loads(s) for s in metrics.read_text().splitlines() if s.strip()]


def epochs_of(metrics: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in metrics if m.get("event") == "epoch"]


def done_of(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    done = [m for m in metrics if m.get("event") == "done"]
    if not done:
        raise RunFailed("the metrics file has no 'done' record")
    return done[-1]


def repeat(fn: Callable[[], dict[str, float]], repeats: int) -> dict[str, list[float]]:
    """Call ``fn`` ``repeats`` times; gather each named number it returns into a sample list."""
    out: dict[str, list[float]] = {}
    for _ in range(repeats):
        for k, v in fn().items():
            if v is not None:
                out.setdefault(k, []).append(float(v))
    return out


# --------------------------------------------------------------------------- tables


def fmt(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "–"
    if x == 0 or 1e-3 <= abs(x) < 1e6:
        return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:,.0f}"
    return f"{x:.2e}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table; a column that is empty in every row is left out, not a column of –."""

    def cell(v: Any) -> str:
        return fmt(v) if v is None or isinstance(v, float) else str(v)

    empty = [i for i in range(len(headers)) if rows and all(cell(r[i]) == "–" for r in rows)]
    if empty:
        keep = [i for i in range(len(headers)) if i not in empty]
        headers = [headers[i] for i in keep]
        rows = [[r[i] for i in keep] for r in rows]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def spread(r: dict[str, Any], metric: str) -> str:
    """'median (min–max)' of one metric, for tables."""
    m = r["metrics"].get(metric)
    if m is None:
        return "–"
    if len(m.get("samples", ())) < 2:  # one run, or a copy that left its samples out
        return fmt(m["median"])
    return f"{fmt(m['median'])} ({fmt(m['min'])}–{fmt(m['max'])})"
