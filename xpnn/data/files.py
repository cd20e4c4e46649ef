"""Opening only regular files, checked on the open descriptor.

A named pipe waits for a writer forever and a device (``/dev/zero``) never ends, so whatever
is about to be read whole (an IDX file, a cached download) is opened without blocking and
refused unless ``fstat`` says it is a regular file; checked on the open file, nothing can be
swapped in between.
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
    """There is something at the path, but not a regular file; ``kind`` says what, in words."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


def file_kind(mode: int) -> str:
    """What a file that is not a regular file is, in words."""
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str | os.PathLike) -> tuple[int, os.stat_result]:
    """A descriptor open for reading on ``path`` and its ``fstat``; ``NotAFile`` when it is not
    a regular file (the descriptor closed). ``os.open``'s and ``fstat``'s errors pass on."""
    fd = os.open(Path(path), os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotAFile(file_kind(info.st_mode))
    except BaseException:
        os.close(fd)
        raise
    return fd, info
