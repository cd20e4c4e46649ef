"""The suite's one runner, one record schema and one description of the machine.

A record is one JSON object per measured configuration, appended to a ``.jsonl`` file:

    {"schema": 1, "benchmark": "scaling", "time": "2026-11-26T08:30:00Z",
     "config": {...what was run...}, "machine": {...describe_machine()...},
     "repeats": 3, "metrics": {"epoch_s": {"median": 1.2, "min": 1.1, "max": 1.4,
     "samples": [...]}, ...}, "info": {...what the runs reported, not timed...},
     "conditions": {"load_before": {...}, "load_after": {...}}, "noisy": [...reasons...],
     "quick": false}

Every number a table or plot shows is read back from such records, so a plot can be redrawn
and a table rebuilt from ``bench/results/*.jsonl`` without measuring again.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
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
IN_CLONE = (ROOT / "pyproject.toml").is_file()  # a checkout, not an installed package
# Records go beside the suite in a checkout; an installed suite writes under the current folder.
RESULTS_DIR = (ROOT / "bench" if IN_CLONE else Path.cwd() / "bench") / "results"


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


def _cpu_quota() -> float | None:
    """Cores this process's cgroup may use (``cpu.max``, cgroup v2); None: no quota set."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else round(int(quota) / int(period), 2)


VERSIONED = ("numpy", "numba", "mpi4py", "threadpoolctl", "torch", "cupy", "xpnn")


def _versions() -> dict[str, str]:
    """The versions of the libraries a timing depends on (those installed)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in VERSIONED:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            continue
    return out


def usable_cores() -> int:
    """CPUs this process may run on, less where a cgroup quota allows fewer."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 1
    quota = _cpu_quota()
    return max(1, min(usable, int(quota))) if quota else usable


def load_now() -> dict[str, Any]:
    """The 1-minute load average and the threads runnable at this instant (``/proc/loadavg``'s
    fourth field, this process among them): the competition a timing meets."""
    try:
        fields = Path("/proc/loadavg").read_text().split()
        return {"load1": float(fields[0]), "runnable": int(fields[3].split("/")[0])}
    except (OSError, ValueError, IndexError):
        try:
            return {"load1": round(os.getloadavg()[0], 2), "runnable": None}
        except (AttributeError, OSError):
            return {"load1": None, "runnable": None}


_last_load: dict[str, Any] = {}  # the load when the previous record (or the machine) was taken


def describe_machine() -> dict[str, Any]:
    """CPU, cores, CPU quota, BLAS and its kernel, MPI library, GPU and the libraries'
    versions: what a number depends on."""
    import numpy

    _last_load.clear()
    _last_load.update(load_now())
    # what the launcher spreads the ranks over, where it is not this one machine
    setup = {"setup": os.environ["XPNN_BENCH_SETUP"]} if os.environ.get("XPNN_BENCH_SETUP") else {}
    return {
        **setup,
        "host": platform.node(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": usable_cores(),
        "cpu_quota": _cpu_quota(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "versions": _versions(),
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
        + (f"; CPU quota {m['cpu_quota']} cores" if m.get("cpu_quota") else "")
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
    """One record; its ``conditions`` hold the load when the previous record (or the machine's
    description) was taken and now, and ``noisy`` the reasons its numbers are not to be
    trusted (empty: none)."""
    repeats = max((len(v) for v in samples.values()), default=0)
    after = load_now()
    out = {
        "schema": SCHEMA,
        "benchmark": benchmark,
        "time": now(),
        "config": config,
        "machine": machine,
        "repeats": repeats,
        "metrics": {k: stats(v) for k, v in samples.items() if len(v)},
        "info": info or {},
        "conditions": {"load_before": dict(_last_load) or after, "load_after": after},
        "quick": False,
    }
    _last_load.update(after)
    out["noisy"] = noise(out)
    return out


WIDE = 1.3  # max / min of repeats past which a measurement is called noisy


def noise(r: dict[str, Any]) -> list[str]:
    """Why a record's numbers are noisy: a spread wider than ``WIDE`` (max / min) in a timed
    metric, or a load average beyond its own threads or more threads runnable than cores while
    it ran (the thread reading ``/proc/loadavg`` not counted). Each reason starts with its kind
    and a colon."""
    why, wide = [], []
    for name, m in r.get("metrics", {}).items():
        xs = m.get("samples") or []
        if len(xs) > 1 and min(xs) > 0 and max(xs) / min(xs) > WIDE and _timed(name):
            wide.append(f"{name} {max(xs) / min(xs):.2f}x")
    if wide:
        why.append(f"wide spread: max/min {', '.join(wide)} (> {WIDE})")
    cores = (r.get("machine") or {}).get("usable_cores") or os.cpu_count() or 1
    cond = r.get("conditions") or {}
    # the 1-minute average still holds this measurement's own threads, and before it those of
    # the one just run the same way: only load beyond them competed with it
    cfg = r.get("config") or {}
    own = math.prod(n if isinstance(n, int) else 1 for n in (cfg.get("ranks"), cfg.get("threads")))
    for when in ("load_before", "load_after"):
        load = cond.get(when) or {}
        others = max(0, (load.get("runnable") or 0) - 1)
        if max((load.get("load1") or 0) - own, others) > cores:
            why.append(
                f"busy machine: {when.replace('_', ' ')} {load.get('load1')}, "
                f"{others} other threads runnable, on {cores} cores"
            )
            break
    return why


def _timed(metric: str) -> bool:
    """A metric that is a time or a rate (accuracies and losses are not timings)."""
    return not any(w in metric for w in ("acc", "loss", "steps", "bytes", "rss", "params"))


def stamp(records: list[dict[str, Any]], quick: bool, quiet: dict[str, Any] | None) -> None:
    """Mark records as a quick run's (small sizes: not comparable) and with the wait for
    quiet that preceded them."""
    for r in records:
        r["quick"] = bool(quick)
        if quiet is not None:
            r.setdefault("conditions", {})["quiet_wait"] = quiet
        r["noisy"] = noise(r)


def marks(records: list[dict[str, Any]]) -> list[str]:
    """The lines every table and figure of ``records`` carries: quick, and noisy with why."""
    out = []
    if any(r.get("quick") for r in records):
        out.append("QUICK RUN: small sizes, a smoke test, not comparable to full runs")
    noisy = [r for r in records if noise(r)]
    if noisy:
        reasons = sorted({w.split(":")[0] for r in noisy for w in noise(r)})
        out.append(f"NOISY: {len(noisy)} of {len(records)} measurements ({'; '.join(reasons)})")
    return out


def noise_notes(records: list[dict[str, Any]]) -> str:
    """Under a table: the marks, then each noisy measurement with its reasons."""
    lines = [f"**{m}**" for m in marks(records)]
    for r in records:
        if noise(r):
            what = ", ".join(f"{k} {v}" for k, v in r["config"].items() if k != "command")
            lines.append(f"- noisy: {what[:120]}: {'; '.join(noise(r))}")
    return "\n".join(lines)


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
    check_xpnn_flags(flags)
    with tempfile.TemporaryDirectory(prefix="xpnn-bench-") as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        run_command(xpnn_command(ranks, [*flags, "--metrics", str(metrics)]), timeout)
        return [json.loads(s) for s in metrics.read_text().splitlines() if s.strip()]


def check_xpnn_flags(flags: Sequence[str]) -> None:
    """Refuse, before a run starts, flags that ``python -m xpnn`` would refuse (a benchmark
    passes some on unchanged): one line naming the flag, as xpnn says it."""
    from xpnn.commands.flags import ArgError, build_parser

    try:
        build_parser().parse_args(list(flags))
    except ArgError as e:
        raise BenchError(f"xpnn refuses the run's flags: {e}") from None


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
    """'median (min–max, n=N)' of one metric, for tables; ' (n=1)' for a single run, and a
    trailing ' †' when the record is noisy (the notes under the table say why)."""
    m = r["metrics"].get(metric)
    if m is None:
        return "–"
    mark = " †" if noise(r) else ""
    n = len(m.get("samples", ()))
    if n < 2:  # one run, or a copy that left its samples out
        return f"{fmt(m['median'])} (n={max(n, 1)}){mark}"
    return f"{fmt(m['median'])} ({fmt(m['min'])}–{fmt(m['max'])}, n={n}){mark}"


def sides_table(records: list[dict[str, Any]], metric: str, column: str, head: str) -> str:
    """A benchmark that times one thing two or more ways (``config["side"]``): ``head`` filled
    from the first record's config (``str.format``), then a row a side with the metric's
    spread over rounds."""
    if not records:
        return "no records"
    rows = [[r["config"]["side"], spread(r, metric)] for r in records]
    return head.format_map(records[0]["config"]) + markdown_table(["side", column], rows)


def sides_bars(records: list[dict[str, Any]], ax: Any, metric: str, **labels: str) -> None:
    """The sides' medians of one metric as bars (``labels``: ``ylabel``, ``title``)."""
    ax.bar([r["config"]["side"] for r in records], [median_of(r, metric) for r in records])
    ax.set(**labels)


def speedup(base: dict[str, Any], r: dict[str, Any], metric: str, ideal: float) -> str:
    """``base``'s time over ``r``'s (medians) with the range the repeats allow (fastest over
    slowest either way); a speedup above ``ideal`` (the ranks) is flagged: as noise where the
    range reaches down to ``ideal``, unconfirmed after one run or on a busy machine, else as
    super-linear (cache, a smaller working set: even the least speedup allowed is above)."""
    b, m = base["metrics"].get(metric), r["metrics"].get(metric)
    if not b or not m or not m["median"]:
        return "–"
    mid = b["median"] / m["median"]
    low, high = b["min"] / m["max"], b["max"] / m["min"]
    text = fmt(mid) if low == high else f"{fmt(mid)} ({fmt(low)}–{fmt(high)})"
    if mid > ideal * 1.0001:
        if low <= ideal:
            why = "noise, within the repeats' range"
        elif min(len(b.get("samples") or ()), len(m.get("samples") or ())) < 2:
            why = "one run each, unconfirmed"
        elif noise(base) or noise(r):
            why = "a noisy measurement, unconfirmed"
        else:
            why = "super-linear"
        text += f" ‡ above the ranks: {why}"
    return text
