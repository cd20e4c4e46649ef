"""Reading only regular files (a pipe waits forever); the machine's memory; live processes."""

import os
import stat
from pathlib import Path

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


class NotAFile(Exception):
    """What is there instead (``a directory``, ``a named pipe``, ...)."""


def open_regular(path: str | os.PathLike) -> tuple[int, os.stat_result]:
    """A descriptor open for reading on ``path`` (opened without blocking) and its ``fstat``."""
    fd = os.open(Path(path), os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = next((what for test, what in _KINDS if test(info.st_mode)), "not a regular file")
            raise NotAFile(kind)
    except BaseException:
        os.close(fd)
        raise
    return fd, info


def memory_bytes() -> int | None:
    """This machine's RAM plus swap, the most any process here could fill; None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return sum(int(fields[k].split()[0]) * 1024 for k in ("MemTotal", "SwapTotal"))
    except (OSError, KeyError, ValueError):
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            return None


class TooLarge(Exception):
    """``1,234 bytes``: the file's size, more than a reader may take."""


def read_regular(path: str | os.PathLike, most: int | None) -> bytes:
    """The bytes of the regular file ``path``, at most ``most`` (else ``TooLarge``)."""
    fd, info = open_regular(path)
    with os.fdopen(fd, "rb") as fh:
        if most is not None and info.st_size > most:
            raise TooLarge(f"{info.st_size:,} bytes")
        data = fh.read(most + 1 if most is not None else -1)
    if most is not None and len(data) > most:  # grew since: read no further
        raise TooLarge(f"{len(data):,} bytes")
    return data


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process (EPERM): there all the same
        return True
    return True
