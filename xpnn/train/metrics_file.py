"""The ``metrics`` file as a faithful record: whole JSON lines only (a write that fails half-way
is taken back), each epoch once (a resume drops what came after its checkpoint), and never a
file that is not one (the data set's labels, another run's checkpoint)."""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from xpnn.errors import UserError
from xpnn.record.files import open_to_write

EVENTS = ("epoch", "eval", "done", "diverged")  # the "event" of every line xpnn writes
FIRST_LINE_BYTES = 1 << 16  # a record is a few hundred bytes; a longer first line is not one


def _regular(path: str | os.PathLike) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def is_record(line: bytes | str) -> bool:
    """Whether ``line`` is one of xpnn's metrics records."""
    try:
        record = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(record, dict) and record.get("event") in EVENTS


def check_metrics_file(path: str | os.PathLike) -> None:
    """Refuse a non-empty regular file whose first line is not an xpnn metrics record: the
    run would empty it (a fresh run) or append to it (a resume)."""
    if not _regular(path):
        return  # absent (made), or a device written in place (/dev/null)
    with open(path, "rb") as fh:
        first = fh.readline(FIRST_LINE_BYTES)
    if first and not (first.endswith(b"\n") and is_record(first)) and not _cut_record(first):
        raise UserError(
            f"`metrics` {path}: exists and is not an xpnn metrics file (its first line is not "
            "an xpnn record); give a new file name, or remove it"
        )


def _cut_record(first: bytes) -> bool:
    """A first line cut short by a full disk, the only line of an xpnn metrics file."""
    return not first.endswith(b"\n") and first.startswith(b'{"event": "')


def append_record(path: str | os.PathLike, record: dict[str, Any]) -> None:
    """Append ``record`` as one JSON line, whole or not at all: on a failed write (a full
    disk) the file is cut back to where it was and the error raised."""
    data = (json.dumps(record, allow_nan=False) + "\n").encode()
    fd = open_to_write(path, os.O_APPEND | os.O_CREAT)
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
        size = os.fstat(fd).st_size if regular else 0
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except BaseException:
            if regular:
                os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


def empty(path: str | os.PathLike) -> None:
    """Empty (or make) the file, for a fresh run; never through another user's link."""
    os.close(open_to_write(path, os.O_CREAT | os.O_TRUNC))


def keep_until(path: str | os.PathLike, epoch: int, step: int | None = None) -> int:
    """For a resume from ``epoch`` (training by steps: from ``step``): drop the records of later
    epochs (steps), written before their checkpoint was, and a line cut short; the number of
    lines dropped."""
    if not _regular(path):
        return 0
    text = Path(path).read_bytes()
    lines = text.split(b"\n")
    cut = lines.pop() != b""  # what follows the last newline: a line cut short, or nothing
    kept = [line for line in lines if not _after(line, epoch, step)]
    dropped = len(lines) - len(kept) + cut
    if dropped:
        _replace(path, b"".join(line + b"\n" for line in kept))
    return dropped


def last_event(path: str | os.PathLike) -> str | None:
    """The ``event`` of the file's last record (None: none, or not a record)."""
    if not _regular(path):
        return None
    with open(path, "rb") as fh:
        fh.seek(max(0, fh.seek(0, os.SEEK_END) - FIRST_LINE_BYTES))
        lines = fh.read().rstrip(b"\n").rsplit(b"\n", 1)
    if not lines[-1] or not is_record(lines[-1]):
        return None
    return json.loads(lines[-1])["event"]


def _after(line: bytes, epoch: int, step: int | None = None) -> bool:
    try:
        record = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return False
    if not isinstance(record, dict):
        return False
    done = record.get("event") == "done"
    if step is not None:
        number, last = record.get("steps" if done else "step"), step
    else:
        number, last = record.get("epochs" if done else "epoch"), epoch
    return isinstance(number, int) and number > last


def _replace(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` beside ``path`` and rename it into place, keeping the file's mode."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
