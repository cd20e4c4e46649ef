"""This machine measured, cached per host, CPU and libraries; what a plan lacks is timed on use."""

import hashlib
import json
import math
import os
import platform
import stat
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

from xpnn.errors import UserError
from xpnn.record.files import replace_whole
from xpnn.runtime.stall import SPIN_S

VERSION = 1
FLOAT_TABLES = ("gemm", "bandwidth", "crowding", "rest", "network")
TABLES = ("key", "comm", *FLOAT_TABLES)  # written even when empty
MAX_FILE_BYTES = 16 << 20  # a calibration is kilobytes; more is not one
MAX_PROBE_RANKS = 16  # more processes than this on one machine are not started to measure
# Between nodes, when a calibration holds no measured network: 25 us and 10 Gb/s Ethernet.
DEFAULT_NETWORK = (25e-6, 8 / 10e9)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def blas() -> str:
    for pool in threadpool_info():
        if pool.get("user_api") == "blas":
            return f"{pool.get('internal_api')} {pool.get('version')} {pool.get('architecture')}"
    return "unknown"


def machine_key(cores: int) -> dict[str, Any]:
    """What a calibration belongs to: another host, core count or library measures anew."""
    return {
        "host": platform.node(),
        "cores": cores,
        "cpu": cpu_model(),
        "numpy": np.__version__,
        "blas": blas(),
        "python": platform.python_version(),
    }


def cache_path(key: dict[str, Any]) -> Path:
    """$XDG_CACHE_HOME/xpnn/calibration (if absolute), else ~/.cache/xpnn/calibration."""
    xdg = os.path.expanduser(os.environ.get("XDG_CACHE_HOME", ""))
    root = Path(xdg) if os.path.isabs(xdg) else Path(os.path.expanduser("~")) / ".cache"
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return root / "xpnn" / "calibration" / f"{key['host'] or 'host'}-{digest}.json"


@dataclass
class Machine:
    """A calibration: measured times keyed by what was measured."""

    key: dict[str, Any]
    gemm: dict[str, float] = field(default_factory=dict)  # "dtype T m k n count" -> seconds
    bandwidth: dict[str, float] = field(default_factory=dict)  # "dtype T" -> values/s
    comm: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # "R" -> op -> [a, b]
    crowding: dict[str, float] = field(default_factory=dict)  # "R" -> slowdown of R 1-thread ranks
    shared: dict[str, list[float]] = field(default_factory=dict)  # "R" -> node-shared [a, b]
    # "R" -> [[s of products alone between two fences, s of the phase with R ranks], ...]
    phases: dict[str, list[list[float]]] = field(default_factory=dict)
    # "backend dtype T model" -> s a sample; the same key + " per-step" -> s a step
    rest: dict[str, float] = field(default_factory=dict)
    network: dict[str, float] = field(default_factory=dict)  # between nodes: alpha, beta
    measured: bool = True  # False: planning for a machine this is not (no new measurements)

    @property
    def cores(self) -> int:
        return int(self.key["cores"])

    def to_json(self) -> dict[str, Any]:
        # shared and phases only when held: a file measured before they existed keeps its digest
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "measured"}
        return {"version": VERSION, **{k: v for k, v in out.items() if v or k in TABLES}}

    def digest(self) -> str:
        """A short name for what this calibration holds: a record names the one it used."""
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:16]

    def network_cost(self) -> tuple[float, float]:
        """(alpha s, beta s per byte) between nodes: the calibration's, else ``DEFAULT_NETWORK``."""
        return (self.network["alpha"], self.network["beta"]) if self.network else DEFAULT_NETWORK

    @property
    def network_measured(self) -> bool:
        return bool(self.network)

    def gemm_seconds(self, m: int, k: int, n: int, count: int, threads: int, dtype: str) -> float:
        """One (count x) m-by-k-by-n product's time: measured, or measured now and kept."""
        if (name := f"{dtype} {threads} {m} {k} {n} {count}") not in self.gemm:
            if not self.measured:
                transposed = f"{dtype} {threads} {n} {k} {m} {count}"  # the same work
                if transposed in self.gemm:
                    return self.gemm[transposed]
                return self._scaled_gemm(m, k, n, count, threads, dtype)
            lead = (count,) if count > 1 else ()  # a batch of products
            rng = np.random.default_rng(0)
            a, b = (rng.standard_normal((*lead, *s)).astype(dtype) for s in ((m, k), (k, n)))
            out = np.empty((*lead, m, n), dtype=dtype)
            with threadpool_limits(limits=threads):
                self.gemm[name] = median_time(lambda: np.matmul(a, b, out=out))
        return self.gemm[name]

    def _scaled_gemm(self, m: int, k: int, n: int, count: int, threads: int, dtype: str) -> float:
        """For a machine measured elsewhere: the nearest measured product, scaled by flops."""
        flops, scaled = m * k * n * count, []
        for name, seconds in self.gemm.items():
            d, t, *dims = name.split()
            if d == dtype and int(t) == threads:
                other = math.prod(int(v) for v in dims)
                scaled.append((abs(np.log(other / flops)), seconds * flops / other))
        if scaled:
            return min(scaled, key=lambda gap_seconds: gap_seconds[0])[1]  # the first of equals
        # a thread count the calibration lacks: the nearest it has, scaled by the threads
        if not (have := sorted({int(g.split()[1]) for g in self.gemm if g.split()[0] == dtype})):
            raise UserError(f"the calibration has no {dtype} products")
        near = min(have, key=lambda t: abs(t - threads))
        return self._scaled_gemm(m, k, n, count, near, dtype) * near / threads

    def values_per_s(self, threads: int, dtype: str) -> float:
        if (name := f"{dtype} {threads}") not in self.bandwidth:
            if not self.measured:
                if not (rates := [v for k, v in self.bandwidth.items() if k.startswith(dtype)]):
                    raise UserError(f"the calibration has no {dtype} bandwidth")
                return max(rates)
            # a fused elementwise pass (read two, write one), as the layers'
            a, b, out = (np.ones(1 << 21, dtype=dtype) for _ in range(3))
            self.bandwidth[name] = 3 * a.size / median_time(lambda: np.multiply(a, b, out=out))
        return self.bandwidth[name]

    def probe(self, ranks: int, quick: bool = True) -> None:
        """Time the collectives, crowding and phases on ``ranks`` processes (``probe``)."""
        command = [mpiexec_path(), "-n", str(ranks), sys.executable, "-m", "xpnn.planner.probe"]
        if quick:
            command.append("--quick")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise UserError(f"calibration: mpiexec -n {ranks} did not run ({exc})") from None
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise UserError(f"calibration: mpiexec -n {ranks} failed: {tail[0]}")
        found = json.loads(done.stdout.strip().splitlines()[-1])
        self.comm[str(ranks)] = found["fits"]
        for table in ("crowding", "shared", "phases"):  # the probe's keys are their names
            getattr(self, table)[str(ranks)] = found[table]

    def _probe_missing(self, ranks: int, table: dict[str, Any]) -> None:
        if str(ranks) not in table and self.measured and ranks <= MAX_PROBE_RANKS:
            self.probe(ranks)

    def collective(self, op: str, ranks: int, nbytes: float) -> float:
        """Seconds for one ``op`` of ``nbytes`` over ``ranks`` (alpha + beta * bytes)."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        self._probe_missing(ranks, self.comm)
        if not (measured := sorted(int(r) for r in self.comm)):
            raise UserError("the calibration has no collective timings (run it with ranks)")
        # the count itself if measured, else the nearest measured, scaled as a ring would
        near = min(measured, key=lambda r: abs(r - ranks))
        alpha, beta = self.comm[str(near)][op]
        ring = (ranks - 1) / ranks / ((near - 1) / near)
        return alpha * (ranks / near) + beta * nbytes * ring

    def shared_exchange(self, ranks: int, nbytes: float) -> float | None:
        """A fence of ``ranks`` node-shared ranks, then ``nbytes`` read by each (None: unknown)."""
        fit = self.shared.get(str(ranks)) if ranks <= self.cores else None
        return None if fit is None else fit[0] + fit[1] * nbytes

    def slowdown(self, busy_threads: int) -> float:
        """How much slower each thread runs with ``busy_threads`` on this machine's cores."""
        cores = self.cores
        if busy_threads <= cores:
            return 1.0
        self._probe_missing(busy_threads, self.crowding)
        ideal = busy_threads / cores  # threads taking turns on the cores, at the least
        if (measured := self.crowding.get(str(busy_threads))) is not None:
            return max(ideal, measured)
        known = [(int(r), v / (int(r) / cores)) for r, v in self.crowding.items() if int(r) > cores]
        penalty = statistics.median(v for _, v in known) if known else 1.0
        return ideal * max(1.0, penalty)

    def sync_wait(self, busy_threads: int, phase: float) -> float:
        """Seconds a synchronization adds to ``busy_threads`` computing ``phase`` s between two."""
        if busy_threads <= self.cores:
            return 0.0
        self._probe_missing(busy_threads, self.phases)
        over = [int(r) for r in self.phases if int(r) > self.cores]
        if not over:  # not measured: the fence of ranks arriving at once, else their spins
            fit = self.shared.get(str(busy_threads))
            return fit[0] if fit else busy_threads / self.cores * SPIN_S
        near = min(over, key=lambda r: abs(r - busy_threads))  # the count itself if measured
        crowded, points = self.slowdown(near), sorted(self.phases[str(near)])
        alone = [w for w, _ in points]
        extra = [max(0.0, t - crowded * w) for w, t in points]
        queued = (busy_threads - self.cores) / (near - self.cores)  # threads beyond the cores
        return queued * float(np.interp(phase, alone, extra))


def median_time(run: Any, floor: float = 0.02, repeats: int = 5) -> float:
    """Median over ``repeats`` of a call's time, each sample long enough to read a clock."""
    run()
    start = time.perf_counter()
    run()
    once = max(time.perf_counter() - start, 1e-7)
    calls = max(1, int(floor / once))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            run()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def mpiexec_path() -> str:
    """The ``mpiexec`` beside this interpreter (the mpich wheel's), else the one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside if os.path.exists(beside) else "mpiexec"


def load(path: Path | str) -> Machine:
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise UserError(f"{path}: no such calibration file") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise UserError(f"{path}: not a regular file")
        raw = f.read(MAX_FILE_BYTES + 1)
    if len(raw) > MAX_FILE_BYTES:
        raise UserError(f"{path}: larger than any calibration ({MAX_FILE_BYTES >> 20} MiB)")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise UserError(f"{path}: not JSON") from None
    if not isinstance(data, dict) or data.get("version") != VERSION:
        raise UserError(f"{path}: not an xpnn calibration (version {VERSION})")

    def floats(name: str) -> dict[str, float]:
        return {str(k): float(v) for k, v in dict(data.get(name, {})).items()}

    try:
        key = dict(data["key"])
        cores = int(key["cores"])
        gemm, bandwidth, crowding, rest, network = map(floats, FLOAT_TABLES)
        comm = {
            str(r): {str(op): [float(a), float(b)] for op, (a, b) in dict(ops).items()}
            for r, ops in dict(data.get("comm", {})).items()
        }
        shared = {str(r): [float(a), float(b)] for r, (a, b) in data.get("shared", {}).items()}
        phases = {
            str(r): [[float(w), float(t)] for w, t in points]
            for r, points in data.get("phases", {}).items()
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"{path}: damaged calibration ({exc})") from None
    if cores < 1 or any(v <= 0 for v in (*gemm.values(), *bandwidth.values())):
        raise UserError(f"{path}: damaged calibration (a time or a core count <= 0)")
    if any(v < 0 for v in rest.values()):
        raise UserError(f"{path}: damaged calibration (a negative time)")
    if network and (set(network) != {"alpha", "beta"} or min(network.values()) < 0):
        raise UserError(f"{path}: damaged calibration (network: alpha and beta, >= 0)")
    return Machine(key, gemm, bandwidth, comm, crowding, shared, phases, rest, network)


def save(machine: Machine, path: Path) -> None:
    """Written whole and renamed over ``path`` (a link there is replaced, never followed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_whole(path, json.dumps(machine.to_json(), indent=1, sort_keys=True).encode())


def cached(cores: int) -> tuple[Machine, Path]:
    """This machine's calibration from the cache (or an empty one to fill), and its path."""
    key = machine_key(cores)
    path = cache_path(key)
    if path.exists() and (machine := load(path)).key == key:
        return machine, path
    return Machine(key), path
