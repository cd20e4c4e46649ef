"""Timing on a shared machine: how many cores other processes kept busy while a block ran,
waiting for quiet, and redoing a measurement that others disturbed."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench.flags import nonneg_float, nonneg_int


def load_avg() -> float | None:
    """1-minute load average (None where the OS has none): other jobs skew CPU timings."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def busy_warning() -> str | None:
    """A warning line when other processes already keep the CPUs busy, else None."""
    load, ncpu = load_avg(), os.cpu_count() or 1
    if load is not None and load > 0.5 * ncpu:
        return (
            f"warning: load average {load:.2f} on {ncpu} CPUs before starting: "
            "other processes compete for the cores, CPU times may be inflated"
        )
    return None


def _cpu_busy_seconds() -> float | None:
    """CPU-seconds all CPUs spent busy since boot (Linux ``/proc/stat``), else None."""
    try:
        with open("/proc/stat") as fh:
            fields = fh.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(v) for v in fields[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    busy = sum(ticks[:8]) - idle  # user..steal; guest time is already inside user
    return busy / os.sysconf("SC_CLK_TCK")


def _pid_cpu_seconds(pid: int) -> float:
    """CPU-seconds of a live process and its waited-for children (``/proc/PID/stat``), else 0."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime..cstime


def _own_cpu_seconds(pids: Sequence[int] = ()) -> float:
    """CPU-seconds used by this process, its waited-for children (e.g. mpiexec runs) and the
    live helper processes ``pids`` (e.g. worker processes that have not exited)."""
    t = os.times()
    own = t.user + t.system + t.children_user + t.children_system
    return own + sum(_pid_cpu_seconds(p) for p in pids)


class ForeignLoad:
    """How many cores *other* processes kept busy while a block ran (None off Linux).

    ``with ForeignLoad() as fl: ...`` then ``fl.cores``: (all CPUs' busy time - this process's
    and its finished children's CPU time - the CPU time of the live processes ``pids``) / wall
    time. Unlike the load average it is exact for the block and ignores our own threads, so a
    timing can be reported with the competition it met: 0.0 is a quiet machine, 1.0 means
    another job used a whole core throughout.
    """

    def __init__(self, pids: Sequence[int] = ()) -> None:
        self.pids = tuple(pids)
        self.cores: float | None = None

    def __enter__(self) -> ForeignLoad:
        self.cores = None
        self._busy0, self._own0 = _cpu_busy_seconds(), _own_cpu_seconds(self.pids)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._t0
        busy1 = _cpu_busy_seconds()
        if self._busy0 is None or busy1 is None or wall <= 0:
            return
        foreign = (busy1 - self._busy0) - (_own_cpu_seconds(self.pids) - self._own0)
        self.cores = round(max(0.0, foreign) / wall, 3)


def foreign_load(interval_s: float = 1.0) -> float | None:
    """Cores other processes keep busy right now, sampled over ``interval_s``."""
    with ForeignLoad() as fl:
        time.sleep(interval_s)
    return fl.cores


def wait_for_quiet(
    max_cores: float = 0.3, timeout_s: float = 0.0, interval_s: float = 2.0
) -> float | None:
    """Wait (at most ``timeout_s``) until others use fewer than ``max_cores`` cores; return the last
    reading. ``timeout_s`` 0 takes one reading and returns at once."""
    deadline = time.monotonic() + timeout_s
    while True:
        cores = foreign_load(min(interval_s, 1.0))
        if cores is None or cores < max_cores or time.monotonic() >= deadline:
            return cores
        time.sleep(max(0.0, interval_s - 1.0))


def measure_quietly(
    fn: Callable[[], Any],
    max_foreign: float,
    retries: int = 5,
    wait_s: float = 120.0,
    pids: Sequence[int] = (),
) -> tuple[Any, float | None, int]:
    """Run ``fn``; while other processes used more than ``max_foreign`` cores meanwhile, wait for
    quiet (up to ``wait_s``) and run it again, at most ``retries`` more times.

    Returns (``fn``'s result, the cores others used during the kept run, runs discarded). On a
    shared machine a job that starts mid-measurement can slow a multi-threaded benchmark several
    fold (spinning thread pools fight for the cores); redoing the few measurements it hit is
    cheaper and more honest than a median over a polluted sample. ``pids``: live helper
    processes whose CPU time is ours, not foreign (see ``ForeignLoad``).
    """
    for attempt in range(retries + 1):
        with ForeignLoad(pids) as fl:
            result = fn()
        if fl.cores is None or fl.cores <= max_foreign or attempt == retries:
            return result, fl.cores, attempt
        wait_for_quiet(max_foreign, wait_s)
    raise AssertionError("unreachable")


def add_quiet_flags(a: Any, what: str, retries: int, quiet_timeout: float) -> None:
    """The flags of ``measure_quietly``: redo a ``what`` that other processes disturbed."""
    a(
        "--max-foreign",
        type=nonneg_float,
        default=0.25,
        help=f"redo a {what} if others used more cores",
    )
    a("--retries", type=nonneg_int, default=retries, help=f"redos per {what} at most (then kept)")
    a(
        "--quiet-timeout",
        type=nonneg_float,
        default=quiet_timeout,
        help="seconds to wait for quiet per redo",
    )


def wait_below_cores(seconds: float, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Wait up to ``seconds`` for the 1-minute load average to fall below the usable cores;
    say whether it did. The result goes into every record (``conditions.quiet_wait``)."""
    from bench.core import load_now, usable_cores

    cores = usable_cores()
    t0 = time.monotonic()
    load = load_now()
    while (load["load1"] or 0) >= cores and time.monotonic() - t0 < seconds:
        time.sleep(min(5.0, max(0.1, seconds - (time.monotonic() - t0))))
        load = load_now()
    quiet = (load["load1"] or 0) < cores
    waited = round(time.monotonic() - t0, 1)
    if seconds > 0:
        say(
            f"quiet-wait: load {load['load1']} "
            + (f"below {cores} cores after {waited} s" if quiet
               else f"still at or above {cores} cores after {waited} s: measuring anyway")
        )  # fmt: skip
    return {"seconds_allowed": seconds, "waited_s": waited, "quiet": quiet, **load}
