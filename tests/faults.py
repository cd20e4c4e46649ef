"""Helpers for the fault tests: start a real ``mpiexec -n 2`` job, find its ranks, hit them at a
chosen moment, and tell what the job left behind in /tmp and /dev/shm."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from conftest import ROOT, xpnn_cmd

from xpnn.runtime.segments import files_in_use

SCRATCH_DIRS = ("/tmp", "/dev/shm")


def snapshot() -> set[str]:
    """Every name directly in /tmp and /dev/shm."""
    names = set()
    for folder in SCRATCH_DIRS:
        try:
            names |= {os.path.join(folder, n) for n in os.listdir(folder)}
        except OSError:
            pass
    return names


def left_behind(before: set[str]) -> list[str]:
    """What appeared in /tmp or /dev/shm since ``before`` and no live process holds: on a
    machine shared with other jobs, theirs are open or mapped while they run; a leak is not."""
    new = {path for path in snapshot() - before if not _made_beside_this_test(path)}
    if new:  # another program's scratch file of the moment (a compiler's) is gone soon after
        time.sleep(0.5)
        held = files_in_use()
        new = {path for path in new if path not in held and os.path.lexists(path)}
    return sorted(new)


HARNESS_PREFIXES = ("pytest-of-",)  # made by test runs beside this one, not jobs
# the benchmark tests' folders (tempfile.mkdtemp(prefix="xpnn-bench-"), ...) and GCC's
# temporary files: training jobs make neither
# and Open MPI's per-job directories (ompi.HOST.UID): xpnn's jobs here run MPICH
# and the flight records a stalled job with no output directory leaves for its user, in a
# folder its stall line names (xpnn-flight-PID-XXXXXXXX): kept on purpose, not a leak
BESIDE = re.compile(
    r"xpnn-[a-z-]+-[a-z0-9_]{8}|xpnn-flight-\d+-[a-z0-9_]{8}|cc[A-Za-z0-9]{6}\.\w+|ompi\..+"
)


def _made_beside_this_test(path: str) -> bool:
    """Names that programs running beside this test on a shared machine make and no training
    job does: pytest's base directory, the benchmark tests' folders, a compiler's scratch."""
    name = os.path.basename(path)
    return name.startswith(HARNESS_PREFIXES) or bool(BESIDE.fullmatch(name))


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(p) for p in fh.read().split()]
    except OSError:
        return []


def rank_pids(launcher: int) -> dict[int, int]:
    """``{rank: pid}`` of the Python processes below ``mpiexec`` (through hydra's proxy)."""
    found = {}
    stack = _children(launcher)
    while stack:
        pid = stack.pop()
        stack += _children(pid)
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                env = dict(item.split(b"=", 1) for item in fh.read().split(b"\0") if b"=" in item)
        except OSError:
            continue
        if b"PMI_RANK" in env and b"xpnn" in Path(f"/proc/{pid}/cmdline").read_bytes():
            found[int(env[b"PMI_RANK"])] = pid
    return found


def maps_numpy(pid: int) -> bool:
    """Whether the process has loaded NumPy's core (xpnn's own imports are under way)."""
    try:
        return "_multiarray_umath" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time the process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _as_from_a_terminal() -> None:
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


class Job:
    """``python -m xpnn ARGS`` under ``mpiexec -n ranks``, as a terminal would start it."""

    def __init__(self, args: list[str], ranks: int = 2, env: dict | None = None) -> None:
        self.proc = subprocess.Popen(
            xpnn_cmd(args, ranks),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            # a shell's background job inherits SIGINT ignored, and nohup's SIGHUP; a
            # terminal's job has neither ignored
            preexec_fn=_as_from_a_terminal,
        )
        self.out = ""

    def ranks(self, count: int, timeout: float = 60) -> dict[int, int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = rank_pids(self.proc.pid)
            if len(found) == count:
                return found
            assert self.proc.poll() is None, self.finish(1)[1]
            time.sleep(0.01)
        raise AssertionError("the ranks did not start")

    def wait_for_line(self, start: str, timeout: float = 120) -> None:
        """Read stdout until a line starts with ``start``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            assert line, f"ended before {start!r}: {self.finish(1)[1]}"
            self.out += line
            if line.startswith(start):
                return
        raise AssertionError(f"no line {start!r} within {timeout} s")

    def finish(self, timeout: float) -> tuple[int | None, str, float]:
        """(exit code or None if it did not end in ``timeout`` s, stderr, seconds taken)."""
        start = time.monotonic()
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            out, err = self.proc.communicate()
            return None, err, time.monotonic() - start
        self.out += out
        return self.proc.returncode, err, time.monotonic() - start

    def kill(self) -> None:
        """End whatever is left of the job (a test that failed half-way)."""
        for pid in [*rank_pids(self.proc.pid).values(), self.proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def writing(pids: list[int], folder: Path) -> bool:
    """Whether one of ``pids`` is writing a file in ``folder``: one without a name yet
    (``O_TMPFILE``, which ``/proc`` shows as ``folder/#INODE (deleted)``) or a ``.tmp``."""
    where = f"{Path(folder).resolve()}/"
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if (
                target.startswith(where)
                and target.endswith(".tmp")
                or (target.startswith(f"{where}#") and target.endswith(" (deleted)"))
            ):
                return True
    return False


def wait_for_write(job: Job, folder: Path, timeout: float = 60) -> None:
    """Until a process of ``job`` (rank 0, in practice) is inside a write in ``folder``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = [job.proc.pid, *rank_pids(job.proc.pid).values()]
        if writing(pids, folder):
            return
        assert job.proc.poll() is None, f"ended before writing: {job.finish(1)[1]}"
        time.sleep(0.005)
    raise AssertionError(f"no write in {folder} within {timeout} s")


def mpi_started(launcher: int) -> bool:
    """Whether every rank of the job has passed ``MPI_Init``: xpnn then removes the topology
    file that hydra's proxy holds open, which shows as ``(deleted)``."""
    stack = _children(launcher)
    for pid in stack:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/tmp/hydra_hwloc_xmlfile_") and target.endswith("(deleted)"):
                    return True
        except OSError:
            continue
    return False


def record(**fields: object) -> None:
    """With ``XPNN_FAULT_LOG=FILE``, one JSON line per case: the tables of docs/reliability.md
    are made from it."""
    log = os.environ.get("XPNN_FAULT_LOG")
    if log:
        with open(log, "a") as fh:
            fh.write(json.dumps(fields) + "\n")
