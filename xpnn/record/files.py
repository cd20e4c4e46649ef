"""Writing only where the run means to: another user who can write a directory could plant a
link at a name xpnn writes (``ck/.xpnn-lock -> /etc/x``). Files are opened with ``O_NOFOLLOW``
(only the running user's own links are followed) and must be regular files or devices; whole
files are written beside their name and renamed over it, replacing a link, not writing through."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def planted(path: str | os.PathLike, why: str) -> OSError:
    """The refusal of a file xpnn will not write (``path_problems`` words it for a flag)."""
    return OSError(errno.ELOOP, why, str(path))


def open_to_write(path: str | os.PathLike, flags: int = 0, mode: int = 0o666) -> int:
    """A write descriptor on ``path``, never through another user's link, nor onto a pipe."""
    flags |= os.O_WRONLY | _CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags | _NOFOLLOW, mode)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        link = os.lstat(path)
        if link.st_uid != os.geteuid():
            why = "a symbolic link of another user; xpnn writes no file through it"
            raise planted(path, why) from None
        fd = os.open(path, flags, mode)
        again = os.lstat(path)
        if (again.st_dev, again.st_ino) != (link.st_dev, link.st_ino):
            os.close(fd)
            raise planted(path, "a symbolic link replaced while it was opened") from None
    try:
        kind = os.fstat(fd).st_mode
        if not (stat.S_ISREG(kind) or stat.S_ISCHR(kind)):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def replace_whole(path: str | os.PathLike, data: bytes) -> None:
    """``path`` holds ``data``, renamed over it: a link is replaced, never written through."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would hide it from the group
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether ``a`` and ``b`` name one existing file (through links, hard ones too)."""
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return False
