"""Opening only regular files, checked on the open descriptor: a named pipe waits forever and
a device never ends, so what is read whole is opened without blocking and checked by ``fstat``.
"""

from __future__ import annotations

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
    """Something at the path that is not a regular file; ``kind`` says what, in words."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


def open_regular(path: str | os.PathLike) -> tuple[int, os.stat_result]:
    """A descriptor open for reading on ``path`` and its ``fstat``; else ``NotAFile``."""
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
