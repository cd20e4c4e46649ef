"""Hydra and MPICH through /proc: what a job leaves if it never finalizes (/dev/shm, /tmp),
unlinked once the node mapped it; ``mpiexec ... | head``: hydra dies by SIGPIPE and kills every
rank, so a rank on its node writes its stdout straight into that pipe and meets it closed itself."""

import contextlib
import glob
import os
import stat
import sys
import time

from xpnn.runtime.threads import proc_text

HYDRA_TOPOLOGY_PREFIX = "/tmp/hydra_hwloc_xmlfile_"  # MPICH hydra's name (MPL_mkstemp)
SHM_DIR = "/dev/shm"  # where MPICH and Open MPI keep node-shared segments on Linux
MPICH_PREFIX = "mpich_shm_"
# hydra options that change what a rank's output becomes: with any of them, leave it to hydra
OUTPUT_OPTIONS = ("-l", "-prepend-rank", "-prepend-pattern", "-outfile-pattern", "-ordered-output")


def _unlink(paths: list[str]) -> list[str]:
    removed = []
    for path in dict.fromkeys(paths):
        with contextlib.suppress(OSError):
            os.unlink(path)
            removed.append(path)
    return removed


def _mapped(maps: str) -> list[str]:
    """The files a ``/proc/PID/maps`` text names (`` (deleted)`` marks one whose name is gone)."""
    fields = (line.split(maxsplit=5) for line in maps.splitlines())
    return [f[5].strip() for f in fields if len(f) == 6]


def mapped_files(maps_path: str = "/proc/self/maps") -> list[str]:
    """The files a ``/proc/PID/maps`` names; none where unreadable."""
    return _mapped(proc_text(maps_path))


def _held(fd_dir: str) -> list[str]:
    targets: list[str] = []
    with contextlib.suppress(OSError):  # not Linux, or closed to us
        for fd in os.listdir(fd_dir):
            with contextlib.suppress(OSError):  # closed meanwhile
                targets.append(os.readlink(os.path.join(fd_dir, fd)))
    return targets


def mpich_segments(maps: str, shm_dir: str = SHM_DIR) -> list[str]:
    """The MPICH segment files that a ``/proc/PID/maps`` text shows mapped and still named."""
    mapped = _mapped(maps)
    found = (p for p in mapped if os.path.split(p)[0] == shm_dir and not p.endswith(" (deleted)"))
    return list(dict.fromkeys(p for p in found if os.path.basename(p).startswith(MPICH_PREFIX)))


def unlink_mpich_segments(maps_path: str = "/proc/self/maps", shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink the MPICH segments this process maps (after a collective over the node)."""
    return _unlink(mpich_segments(proc_text(maps_path), shm_dir))


def hydra_topology_files(fd_dir: str) -> list[str]:
    """The hydra topology files that the process of ``fd_dir`` (``/proc/PID/fd``) holds open."""
    return list(dict.fromkeys(t for t in _held(fd_dir) if t.startswith(HYDRA_TOPOLOGY_PREFIX)))


def unlink_hydra_topology(fd_dir: str | None = None) -> list[str]:
    """Unlink the topology file of the hydra proxy (the parent), after a node collective."""
    return _unlink(hydra_topology_files(fd_dir or f"/proc/{os.getppid()}/fd"))


def files_in_use() -> set[str]:
    """The files that the processes this user may inspect hold open or map."""
    used: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        used.update(_held(f"/proc/{pid}/fd"), mapped_files(f"/proc/{pid}/maps"))
    return used


def remove_stale(min_age: float = 60.0, shm_dir: str = SHM_DIR) -> list[str]:
    """Remove this user's MPICH files ``min_age`` s old that no process uses (a live job's does)."""
    if not os.path.isdir("/proc"):
        return []
    starts = (os.path.join(glob.escape(shm_dir), MPICH_PREFIX), glob.escape(HYDRA_TOPOLOGY_PREFIX))
    now, uid, old = time.time(), os.getuid(), []
    for path in (path for start in starts for path in glob.glob(f"{start}*")):
        with contextlib.suppress(OSError):  # gone meanwhile
            info = os.lstat(path)
            if info.st_uid == uid and now - info.st_mtime >= min_age:
                old.append(path)
    if not old:
        return []
    used = files_in_use()
    return _unlink([path for path in old if path not in used])


def launcher_stdout(proc: str = "/proc") -> str | None:
    """``/proc/PID/fd/1`` of this rank's hydra ``mpiexec`` where it is a pipe, else None."""
    proxy = os.getppid()  # the rank's parent: the proxy hydra starts on each node
    try:  # the proxy's parent
        launcher = int(proc_text(f"/proc/{proxy}/stat").rsplit(")", 1)[1].split()[1])
    except (ValueError, IndexError):
        return None
    names = (proc_text(f"/proc/{proxy}/comm").strip(), proc_text(f"/proc/{launcher}/comm").strip())
    if names[0] != "hydra_pmi_proxy" or names[1] not in ("mpiexec", "mpiexec.hydra", "mpirun"):
        return None
    cmdline = proc_text(f"/proc/{launcher}/cmdline").split("\0")[1:]
    if any(arg.startswith(OUTPUT_OPTIONS) for arg in cmdline):
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
