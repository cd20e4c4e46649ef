"""``mpiexec ... | head -1``: hydra's ``mpiexec`` copies the ranks' output into the pipe, and
once its reader has gone the copy kills ``mpiexec`` by SIGPIPE, whose proxy then kills every
rank with SIGKILL: no line, a checkpoint half-written. A rank on ``mpiexec``'s node therefore
writes its stdout straight into that pipe (the same pipe, opened through ``/proc``), so that
the rank meets the closed pipe itself (``BrokenPipeError``) and stops as a rank does, while
``mpiexec``, which then writes nothing there, lives to report it."""

from __future__ import annotations

import os
import stat
import sys

HYDRA_PROXY = "hydra_pmi_proxy"  # the process hydra starts on each node; the ranks' parent
LAUNCHERS = ("mpiexec", "mpiexec.hydra", "mpirun")
# hydra options that change what a rank's output becomes: with any of them, leave it to hydra
OUTPUT_OPTIONS = ("-l", "-prepend-rank", "-prepend-pattern", "-outfile-pattern", "-ordered-output")


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _options(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return [arg.decode(errors="replace") for arg in fh.read().split(b"\0")]
    except OSError:
        return []


def launcher_stdout(proc: str = "/proc") -> str | None:
    """``/proc/PID/fd/1`` of this rank's hydra ``mpiexec`` when that is a pipe this rank may
    write into directly; None otherwise (no hydra, another node, a file, a terminal)."""
    proxy = os.getppid()
    if _name(proxy) != HYDRA_PROXY:
        return None
    launcher = _parent(proxy)
    if launcher is None or _name(launcher) not in LAUNCHERS:
        return None
    if any(arg.startswith(OUTPUT_OPTIONS) for arg in _options(launcher)[1:]):
        return None
    path = f"{proc}/{launcher}/fd/1"
    try:
        # a pipe only: a file opened anew through /proc would be written from its start
        return path if stat.S_ISFIFO(os.stat(path).st_mode) else None
    except OSError:
        return None


def write_stdout_into_launchers_pipe() -> bool:
    """Point this process's stdout at its launcher's stdout pipe (see the module); whether it
    did. Under any other launcher, or none, stdout stays as it is."""
    if "PMI_RANK" not in os.environ:  # hydra sets it for every rank it starts
        return False
    path = launcher_stdout()
    if path is None:
        return False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # its reader has gone already, or /proc is closed to us
        return False
    os.set_blocking(fd, True)  # O_NONBLOCK only so that the open cannot wait for a reader
    try:
        sys.stdout.flush()
        os.dup2(fd, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    finally:
        os.close(fd)
    return True
