"""One job at a time in a directory: a ``flock`` naming its holder, dropped however it ends."""

import atexit
import contextlib
import errno
import json
import os
import socket
import stat
import time
from pathlib import Path

from xpnn.data.files import pid_alive
from xpnn.errors import UserError
from xpnn.record.files import planted

LOCK_NAME = ".xpnn-lock"
# Slurm, PBS/Torque, LSF, SGE, Flux
JOB_ID_VARS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "JOB_ID", "FLUX_JOB_ID")
_held: dict[Path, int] = {}  # the lock file (its directory resolved) -> the descriptor holding it
_WHAT = {
    "checkpoint_dir": ("in one directory", "checkpoints", "directory"),
    "metrics": ("on one metrics file", "records", "file"),
}


def _holder(fd: int) -> dict | None:
    try:
        who = json.loads(os.pread(fd, 4096, 0).decode("utf-8", "replace"))
    except (OSError, ValueError):
        return None
    return who if isinstance(who, dict) else None


def _refusal(param: str, path: str | os.PathLike, fd: int) -> UserError:
    where, what, other = _WHAT[param]
    who, holder = _holder(fd), "another job (its lock file names no holder)"
    if who is not None:
        job = f"job {who['job_id']}, " if who.get("job_id") else ""
        started, since = who.get("started"), ""
        if isinstance(started, int | float):
            since = time.strftime(", running since %Y-%m-%d %H:%M:%S UTC", time.gmtime(started))
        holder = f"{job}pid {who.get('pid', '?')} on {who.get('host', '?')}{since}"
    return UserError(
        f"`{param}` {path}: in use by {holder}; two jobs {where} would "
        f"overwrite each other's {what}: wait for it to end, stop it, or give another {other}"
    )


def _stale_without_flock(fd: int) -> bool:
    """Without ``flock`` (some NFS): the holder is gone if it ran here and its pid is dead."""
    if not (who := _holder(fd)):
        return True
    pid = who.get("pid")
    return who.get("host") == socket.gethostname() and isinstance(pid, int) and not pid_alive(pid)


def hold(directory: str | os.PathLike) -> Path:
    """Lock ``directory`` for this process, or a UserError naming the live holder."""
    return _hold(Path(directory) / LOCK_NAME, "checkpoint_dir", directory)


def hold_metrics(path: str | os.PathLike) -> Path:
    """Lock the metrics file ``path`` (``.NAME.xpnn-lock`` beside it)."""
    return _hold(Path(path).parent / f".{Path(path).name}{LOCK_NAME}", "metrics", path)


def _hold(path: Path, param: str, named: str | os.PathLike) -> Path:
    key = path.parent.resolve() / path.name
    if key in _held:
        return path
    for _ in range(100):  # another job removed the file between its open and its lock
        if (fd := _locked(param, named, path)) is not None:
            break
    else:
        raise UserError(f"`{param}` {named}: {path.name} keeps being replaced")
    _held[key] = fd
    return path


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _open_lock_file(path: Path) -> int:
    """The lock file, never a planted symlink or hard link: the holder's line would overwrite it."""
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
    """``path``'s descriptor locked and naming this process; None: the file was replaced."""
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
        job = next((os.environ[v] for v in JOB_ID_VARS if os.environ.get(v)), None)
        who = {"host": socket.gethostname(), "pid": os.getpid(), "job_id": job}
        who["started"] = round(time.time(), 3)
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(who) + "\n").encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def release_all() -> None:
    """Remove the lock files this process holds, then drop the locks."""
    while _held:
        path, fd = _held.popitem()
        with contextlib.suppress(OSError):
            if _same_file(fd, path):
                path.unlink()
        os.close(fd)


atexit.register(release_all)
