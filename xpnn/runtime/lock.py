"""One job at a time in a checkpoint directory: ``hold(directory)`` takes an advisory lock
(``flock``) on ``DIR/.xpnn-lock`` for the rest of the process, and writes who holds it (host,
pid, job id, start time) into that file. The kernel drops the lock when the holder exits in any
way (``kill -9`` included), so a lock whose holder is gone is never in force; only its file
stays, rewritten by the next holder. A process that ends normally removes the file while it
still holds the lock, and a taker checks that the file it locked is still the one named, so
two jobs never hold two files of one name."""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import socket
import stat
import time
from pathlib import Path

from xpnn.errors import UserError
from xpnn.record.files import planted

LOCK_NAME = ".xpnn-lock"
# the job schedulers' job ids, in the order asked: Slurm, PBS/Torque, LSF, SGE, Flux
JOB_ID_VARS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "JOB_ID", "FLUX_JOB_ID")
_held: dict[str, int] = {}  # the lock file (its directory resolved) -> the descriptor holding it


def job_id() -> str | None:
    """The batch scheduler's id of this job, or None outside one."""
    return next((os.environ[v] for v in JOB_ID_VARS if os.environ.get(v)), None)


def holder_words(text: str) -> str:
    """What a lock file says of its holder, as a refusal names it."""
    try:
        who = json.loads(text)
        if not isinstance(who, dict):
            raise ValueError
    except ValueError:
        return "another job (its lock file names no holder)"
    job = f"job {who['job_id']}, " if who.get("job_id") else ""
    started = who.get("started")
    since = (
        time.strftime(", running since %Y-%m-%d %H:%M:%S UTC", time.gmtime(started))
        if isinstance(started, int | float)
        else ""
    )
    return f"{job}pid {who.get('pid', '?')} on {who.get('host', '?')}{since}"


def _refusal(param: str, path: str | os.PathLike, fd: int) -> UserError:
    try:
        text = os.pread(fd, 4096, 0).decode("utf-8", "replace")
    except OSError:
        text = ""
    return UserError(
        f"`{param}` {path}: in use by {holder_words(text)}; two jobs {_WHAT[param]}: wait "
        "for it to end, stop it, or give another "
        + ("directory" if param == "checkpoint_dir" else "file")
    )


_WHAT = {
    "checkpoint_dir": "in one directory would overwrite each other's checkpoints",
    "metrics": "on one metrics file would overwrite each other's records",
}


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _stale_without_flock(fd: int) -> bool:
    """Where the file system has no ``flock`` (some NFS mounts): the recorded holder is gone
    if it ran on this host and its pid is dead; a holder on another host counts as alive."""
    try:
        who = json.loads(os.pread(fd, 4096, 0).decode("utf-8", "replace") or "{}")
    except (OSError, ValueError):
        return True
    if not isinstance(who, dict) or not who:
        return True
    pid = who.get("pid")
    return (
        who.get("host") == socket.gethostname()
        and isinstance(pid, int)
        and not (_process_alive(pid))
    )


def hold(directory: str | os.PathLike) -> Path:
    """Lock ``directory`` (which must exist) for this process, or raise a ``UserError``
    naming the live holder; taking it again in the same process does nothing."""
    return _hold(Path(directory) / LOCK_NAME, "checkpoint_dir", directory)


def hold_metrics(path: str | os.PathLike) -> Path:
    """Lock the metrics file ``path`` as a checkpoint directory is, through a lock file
    beside it (``.NAME.xpnn-lock``): a second job would empty or interleave its records."""
    return _hold(Path(path).parent / f".{Path(path).name}{LOCK_NAME}", "metrics", path)


def _hold(path: Path, param: str, named: str | os.PathLike) -> Path:
    key = str(path.parent.resolve() / path.name)
    if key in _held:
        return path
    for _ in range(100):  # another job removed the file between its open and its lock
        fd = _locked(param, named, path)
        if fd is not None:
            break
    else:
        raise UserError(f"`{param}` {named}: {path.name} keeps being replaced")
    _held[key] = fd
    return path


def _same_file(fd: int, path: Path) -> bool:
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (named.st_dev, named.st_ino)


def _open_lock_file(path: Path) -> int:
    """The lock file, made or opened, never through a symbolic link nor onto another file's
    hard link: another user who can write the directory could plant either, and the holder's
    line would overwrite the file it points to."""
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags | os.O_NONBLOCK, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            why = f"{path.name} is a symbolic link; xpnn locks no file through one: remove it"
            raise planted(path, why) from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        what = "has other hard links" if stat.S_ISREG(info.st_mode) else "is not a regular file"
        raise planted(path, f"{path.name} {what}; xpnn locks no such file: remove it")
    os.set_blocking(fd, True)
    return fd


def _locked(param: str, named: str | os.PathLike, path: Path) -> int | None:
    """The descriptor of ``path`` locked and naming this process, or None to try again."""
    import fcntl

    fd = _open_lock_file(path)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise _refusal(param, named, fd) from None
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            if not _stale_without_flock(fd):
                raise _refusal(param, named, fd) from None
        if not _same_file(fd, path):
            os.close(fd)
            return None
        who = {"host": socket.gethostname(), "pid": os.getpid(), "job_id": job_id()}
        who["started"] = round(time.time(), 3)
        data = (json.dumps(who) + "\n").encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def release_all() -> None:
    """Remove the lock files this process holds, then drop the locks (at exit)."""
    while _held:
        name, fd = _held.popitem()
        path = Path(name)
        with contextlib.suppress(OSError):
            if _same_file(fd, path):
                path.unlink()
        os.close(fd)


atexit.register(release_all)
