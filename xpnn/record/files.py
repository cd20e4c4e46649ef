"""Writing never through another user's link: ``O_NOFOLLOW`` opens, whole files renamed over."""

import contextlib
import errno
import os
import secrets
import stat
import tempfile
from collections.abc import Iterator
from typing import BinaryIO

from xpnn.errors import UserError

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def planted(path: str | os.PathLike, why: str) -> OSError:
    """The refusal of a file xpnn will not write (``path_problems`` words it for a flag)."""
    return OSError(errno.ELOOP, why, str(path))


def open_to_write(path: str | os.PathLike, flags: int = 0, mode: int = 0o666) -> int:
    """A write descriptor on ``path``, never through another user's link, nor onto a pipe."""
    flags |= os.O_WRONLY | _CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), mode)
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


@contextlib.contextmanager
def whole_file(path: str | os.PathLike, mode: int | None = None) -> Iterator[BinaryIO]:
    """A file renamed over ``path`` once whole and on disk: a crash or ``kill -9`` leaves it be."""
    directory = os.path.dirname(os.path.abspath(path))
    if mode is None:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd = tmp = None
    if (flag := getattr(os, "O_TMPFILE", None)) and os.path.isdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # EOPNOTSUPP, or EISDIR from a kernel without it
            fd = os.open(directory, flag | os.O_WRONLY, 0o666)  # a file without a name; less umask
    if fd is None:  # not Linux, NFS, or no ``/proc``
        name = os.path.basename(path) + "."
        fd, tmp = tempfile.mkstemp(prefix=name, suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())  # on disk before its name is: a power cut leaves no empty file
            if tmp is None:
                tmp = _link_unnamed(fh.fileno(), path)
        os.chmod(tmp, mode)  # mkstemp's 0600 would hide it from the group
        os.replace(tmp, path)
    except BaseException:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # the rename made durable, where a directory syncs
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _link_unnamed(fd: int, path: str | os.PathLike) -> str:
    root = os.open("/", os.O_RDONLY)
    try:
        for _ in range(8):
            tmp = f"{os.path.abspath(path)}.{secrets.token_hex(4)}.tmp"
            try:  # a directory fd makes Python call linkat(), which follows /proc's link
                os.link(f"/proc/self/fd/{fd}", tmp, src_dir_fd=root)
            except FileExistsError:
                continue
            return tmp
        raise FileExistsError(errno.EEXIST, f"no free temporary name beside {path}")
    finally:
        os.close(root)


def read_regular(path: str | os.PathLike, most: int, said: str, what: str) -> bytes:
    """A regular file's bytes, at most ``most``: a device, FIFO or larger file is refused."""
    try:  # O_NONBLOCK: opening a FIFO must not wait for a writer
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | _CLOEXEC), "rb") as fh:
            info = os.fstat(fh.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise UserError(f"{said}: not a regular file (is it {what}?)")
            if info.st_size > most:
                why = f"more than {what} holds ({most // 2**20} MiB at most)"
                raise UserError(f"{said}: {info.st_size / 2**20:.0f} MiB, {why}")
            return fh.read(most + 1)
    except OSError as exc:
        raise UserError(f"{said}: cannot read ({exc.strerror or exc})") from None


def replace_whole(path: str | os.PathLike, data: bytes) -> None:
    """``path`` holds ``data``, renamed over it: a link is replaced, never written through."""
    with whole_file(path) as fh:
        fh.write(data)


def check_output(said: str, path: str, reads: list, what: str, suffix: str = "") -> None:
    """An output: named ``suffix``, in a directory, no device, none of the files read (``what``)."""
    if not path.lower().endswith(suffix):
        raise UserError(f"{said}: give a file name ending in {suffix}")
    if any(same_file(path, read) for read in reads):
        raise UserError(f"{said}: {what} this command reads; give another name")
    if os.path.isdir(path):
        raise UserError(f"{said}: is a directory; give a file name")
    if os.path.exists(path) and not os.path.isfile(path):
        raise UserError(f"{said}: exists and is not a regular file")
    if not os.path.isdir(parent := os.path.dirname(os.path.abspath(path))):
        raise UserError(f"{said}: directory {parent} does not exist")


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether ``a`` and ``b`` name one existing file (through links, hard ones too)."""
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return False
