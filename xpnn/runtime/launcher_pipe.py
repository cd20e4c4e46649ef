"""``mpiexec ... | head -1``: hydra dies by SIGPIPE and kills every rank, so a rank on its node
writes its stdout straight into that pipe (through ``/proc``) and meets the closed pipe itself."""

import contextlib
import os
import stat
import sys

# hydra options that change what a rank's output becomes: with any of them, leave it to hydra
OUTPUT_OPTIONS = ("-l", "-prepend-rank", "-prepend-pattern", "-outfile-pattern", "-ordered-output")


def _proc(pid: int, what: str) -> str:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/{what}", "rb") as fh:
        return fh.read().decode(errors="replace")
    return ""


def launcher_stdout(proc: str = "/proc") -> str | None:
    """``/proc/PID/fd/1`` of this rank's hydra ``mpiexec`` where it is a pipe, else None."""
    proxy = os.getppid()  # the rank's parent: the proxy hydra starts on each node
    try:  # the proxy's parent
        launcher = int(_proc(proxy, "stat").rsplit(")", 1)[1].split()[1])
    except (ValueError, IndexError):
        return None
    names = (_proc(proxy, "comm").strip(), _proc(launcher, "comm").strip())
    if names[0] != "hydra_pmi_proxy" or names[1] not in ("mpiexec", "mpiexec.hydra", "mpirun"):
        return None
    if any(arg.startswith(OUTPUT_OPTIONS) for arg in _proc(launcher, "cmdline").split("\0")[1:]):
        return None
    path = f"{proc}/{launcher}/fd/1"
    with contextlib.suppress(OSError):  # a pipe only: a file opened anew would be written from 0
        return path if stat.S_ISFIFO(os.stat(path).st_mode) else None
    return None


def write_stdout_into_launchers_pipe() -> bool:
    """Point stdout at the launcher's stdout pipe; whether it did."""
    path = launcher_stdout() if "PMI_RANK" in os.environ else None  # set by hydra
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
