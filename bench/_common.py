"""Helpers of the scripts in ``bench/`` that keep a command of their own (throughput,
optimizer_step, core_contention, within_job, step_phases, staging): flags checked before
measuring, one-line errors, medians, text tables, waiting for a quiet machine. The suite
(``python -m bench``) runs them and turns what they write into records (bench/core.py).
Nothing here imports xpnn, CuPy or matplotlib at import time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

# The checkout's xpnn, whether or not it is installed in this Python: the scripts measure the
# code next to them, and their one-line errors (which ask xpnn who prints) need it importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run_main(main: Callable[[], int | None]) -> None:
    """``sys.exit(main())``, except that a reader that goes away (``... | head``) or Ctrl-C
    ends the script as it ends ``python -m xpnn``: one line, exit 141 or 130, no traceback.
    xpnn's messages name its flags, as ``python -m xpnn`` says them."""
    from xpnn.cli import flag_words
    from xpnn.errors import worded

    try:
        with worded(flag_words):
            code = main()
    except (BrokenPipeError, KeyboardInterrupt) as exc:  # a run being timed stops with us
        from xpnn.runtime import stopped_from_outside

        message, code = stopped_from_outside(exc) or ("stopped", 1)
        print(f"{Path(sys.argv[0]).name}: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


RESULTS_DIR = Path(__file__).resolve().parent / "results"
"""Default output folder, next to the scripts so the cwd does not matter."""


def median(samples: Sequence[float]) -> float:
    """Median of timing samples: robust to the one run the OS interrupted."""
    if not samples:
        raise ValueError("median of no samples")
    return float(statistics.median(samples))


def fmt_num(value: float | None, digits: int = 3) -> str:
    """A table cell: ``-`` for missing, else ``digits`` significant figures."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if value == 0:
        return "0"
    mag = math.floor(math.log10(abs(value)))
    decimals = max(0, digits - 1 - mag)
    return f"{value:.{decimals}f}"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Plain-text table, first column left-aligned and the rest right-aligned."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        out = [cells[0].ljust(widths[0])]
        out += [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join(out).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def write_json(path: Path, obj: Any) -> None:
    """Pretty JSON; NaN/inf are not valid JSON, so callers should use ``None``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, allow_nan=False) + "\n")


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


def machine_info() -> dict[str, Any]:
    """Enough context to tell whether two result files are comparable."""
    return {
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_avg_1m": load_avg(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


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


# -- running ``python -m xpnn`` jobs -----------------------------------------------------------


class RunFailed(RuntimeError):
    """An ``mpiexec ... python -m xpnn`` run failed or ran out of time: the message names the
    command and ends with the last lines it printed (xpnn's own one-line reason among them)."""


def _tail(text: str | bytes | None, lines: int = 10) -> list[str]:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "").strip().splitlines()[-lines:]


def run_job(cmd: Sequence[str], timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` from the project root with xpnn importable (``PYTHONPATH``), capturing its
    output; a non-zero exit or ``timeout`` seconds passing is a ``RunFailed``."""
    root = str(Path(__file__).resolve().parents[1])
    pythonpath = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=pythonpath)
    try:
        proc = subprocess.run(
            list(cmd), capture_output=True, text=True, env=env, cwd=root, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        raise RunFailed(
            f"run timed out after {timeout:g} s (--timeout): {' '.join(cmd)}\n  "
            + "\n  ".join(_tail(exc.stderr))
        ) from None
    if proc.returncode != 0:
        raise RunFailed(
            f"run failed (exit {proc.returncode}): {' '.join(cmd)}\n  "
            + "\n  ".join(_tail(proc.stderr or proc.stdout))
        )
    return proc


# -- the command line: one-line usage errors, printed once under mpiexec ----------------------


def launch_rank() -> int:
    """This process's rank as the launcher's environment says (0 outside mpiexec), without
    starting MPI: xpnn's own rule."""
    from xpnn.runtime import launch_rank as xpnn_launch_rank

    return xpnn_launch_rank()


class Parser(argparse.ArgumentParser):
    """argparse as ``python -m xpnn`` uses it: a usage error is the one line ``PROG: error:
    MESSAGE`` (no usage block; a type check's message names its flag once, ``--cpus: ...``),
    exit 2; under mpiexec every rank parses the same flags, so rank 0 alone prints it (and
    ``--help``)."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        message = message.removeprefix("argument ")
        if launch_rank() == 0:
            print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)

    def _print_message(self, message: str, file: Any = None) -> None:
        if launch_rank() == 0:
            super()._print_message(message, file)


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each flag's default, once and as the flag takes it: ``1,2`` for a list,
    nothing where the help already says it ("default ..."), where there is none (``None``) or
    for an on/off switch (``--split``: off unless given)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        shown = action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE)
        switch = action.nargs == 0
        if not shown or switch or "default" in text or default in (None, argparse.SUPPRESS):
            return action.help
        if isinstance(default, (list, tuple)):
            value = ",".join(map(str, default)).replace("%", "%%")
        else:
            value = "%(default)s"
        return f"{text} (default: {value})" if text else f"(default: {value})"


# -- command-line value parsers shared by the benchmarks --------------------------------------


def int_list(text: str) -> list[int]:
    """``1,2,4`` -> [1, 2, 4]; every value positive (repeats allowed: ``--hidden 64,64``)."""
    return _ints_at_least(text, 1, "integers like 1,2", "positive integers")


def distinct_int_list(text: str) -> list[int]:
    """``1,2,4`` -> [1, 2, 4]; every value positive, none given twice (each is one run)."""
    return _no_repeats(int_list(text), text)


def cpu_list(text: str) -> list[int]:
    """``0,1`` -> [0, 1]: CPU numbers, from 0. A CPU may be named twice: ``core_contention``
    then pins two processes to it, which is how it measures a core shared by two ranks."""
    return _ints_at_least(text, 0, "CPU numbers like 0,1", "CPU numbers like 0,1")


def _no_repeats(values: list, text: str) -> list:
    """``values`` unchanged, unless one of them is given twice: a usage error naming it."""
    seen: set = set()
    for v in values:
        if v in seen:
            raise argparse.ArgumentTypeError(f"{v!r} given twice in {text!r}")
        seen.add(v)
    return values


def _ints_at_least(text: str, low: int, form: str, kind: str) -> list[int]:
    """A comma list of integers, at least one, none below ``low``; the messages say what was
    expected: ``form`` for text that is not integers, ``kind`` for values that are too low."""
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {form}, got {text!r}") from None
    if not values or min(values) < low:
        raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}")
    return values


def positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def timed_epochs(text: str) -> int:
    """Epochs per run where the first is not timed: 2 at least, else nothing would be."""
    value = _int_at_least(text, 1)
    if value < 2:
        raise argparse.ArgumentTypeError(
            f"must be >= 2, got {value}: the first epoch includes compilation and is not timed"
        )
    return value


def nonneg_int(text: str) -> int:
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
    return value


def nonneg_float(text: str) -> float:
    """A finite number >= 0 (``nan`` and ``inf`` are refused: they break comparisons, waits and
    JSON)."""
    value = _finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def choice_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """A parser for a comma list of names among ``choices``: at least one, no unknown name,
    none given twice."""
    known = ",".join(choices)

    def parse(text: str) -> list[str]:
        names = [t.strip() for t in text.split(",") if t.strip()]
        if not names:
            raise argparse.ArgumentTypeError(f"empty: give a comma list of {known}")
        bad = [n for n in names if n not in choices]
        if bad:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(map(repr, bad))}: choose among {known}"
            )
        return _no_repeats(names, text)

    return parse


def executable(text: str) -> str:
    """A program to run (e.g. ``--mpiexec``): a path to an executable file, or a name found on
    PATH; returned as an absolute path (the runs may start in another folder). Checked now, not
    when the first run fails to start."""
    nonempty_path(text)
    if os.sep not in text and (os.altsep is None or os.altsep not in text):
        found = shutil.which(text)
        if found is None:
            raise argparse.ArgumentTypeError(f"{text!r} is not on PATH")
        return found
    path = Path(text)
    try:
        if not path.exists():
            raise argparse.ArgumentTypeError(f"{text} does not exist")
        if not path.is_file() or not os.access(path, os.X_OK):
            raise argparse.ArgumentTypeError(f"{text} is not an executable file")
    except OSError as exc:  # under a directory this user may not enter even stat() fails
        raise argparse.ArgumentTypeError(f"{text}: {exc.strerror}") from None
    return os.path.abspath(text)


# -- output paths, checked before anything is measured -----------------------------------------


def nonempty_path(text: str) -> str:
    """A file or folder name as given; an empty one is a slip (the shell's ``--json $UNSET``),
    refused as xpnn refuses it rather than read as the current folder."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty path")
    return text


def out_path(text: str) -> Path:
    """``--json``, ``--csv``, ``--out``: a non-empty path."""
    return Path(nonempty_path(text))


def _takes_files(directory: Path) -> str | None:
    """Why ``directory`` cannot take a new file (None: it can). A throwaway file proves it:
    permissions, read-only mounts and pseudo file systems (/proc, /sys) all show up here, as
    in xpnn's own command line."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        return f"cannot create files in {directory} ({exc.strerror})"
    return None


def file_problem(path: Path) -> str | None:
    """Why a result file cannot be written at ``path`` (None: it can): its directory must
    exist and take files."""
    if path.is_dir():
        return "is a directory; give a file name"
    parent = path.parent
    if not parent.is_dir():
        return f"directory {parent} does not exist"
    return _takes_files(parent)


def folder_problem(path: Path) -> str | None:
    """Why ``path`` cannot be an output folder (None: it can): it is a folder that takes files,
    or it can be made (its nearest existing ancestor is a folder that takes files)."""
    if path.is_dir():
        return _takes_files(path)
    if path.exists():
        return "exists and is not a directory"
    probe = path.parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return f"cannot be made: {probe} is not a directory"
    problem = _takes_files(probe)
    return None if problem is None else f"cannot be made: {problem}"


def refuse_unwritable(
    parser: argparse.ArgumentParser, flag: str, path: Path, folder: bool = False
) -> None:
    """A usage error (exit 2, one line naming ``flag``) unless results can be written at
    ``path``: a file, or with ``folder`` an output folder the script makes when missing."""
    try:
        problem = folder_problem(path) if folder else file_problem(path)
    except OSError as exc:  # under a directory this user may not enter even stat() fails
        problem = exc.strerror or type(exc).__name__
    if problem is not None:
        parser.error(f"{flag} {path}: {problem}")


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


# -- xpnn's own checks, made before the first run rather than by it ---------------------------


def data_dir_problem(dataset: str, data_dir: str) -> str | None:
    """Why ``data_dir`` does not hold ``dataset``'s four IDX files (None: it does), as xpnn's
    ``--data-dir`` lookup says it (``--data-dir DIR: no such directory``, ``...: missing ...``)."""
    from xpnn.cli import flag_words
    from xpnn.data import find_files
    from xpnn.errors import UserError

    try:
        find_files(dataset, data_dir, download=False)
    except UserError as exc:
        return flag_words(str(exc))
    return None
