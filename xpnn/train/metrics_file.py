"""The ``metrics`` file: whole JSON lines, each record once after a resume, no other file."""

import json
import os
import stat
from pathlib import Path
from typing import Any

from xpnn.errors import UserError
from xpnn.record.files import open_to_write, whole_file

EVENTS = ("epoch", "eval", "done", "diverged")  # the "event" of every line xpnn writes
FIRST_LINE_BYTES = 1 << 16  # a record is a few hundred bytes; a longer first line is not one


def _parsed(line: bytes | str) -> dict[str, Any]:  # {}: no JSON object
    try:
        record = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return {}
    return record if isinstance(record, dict) else {}


def is_record(line: bytes | str) -> bool:
    return _parsed(line).get("event") in EVENTS


def check_metrics_file(path: str | os.PathLike) -> None:
    """Refuse a file whose first line is no xpnn record: a run would empty or append to it."""
    if not os.path.isfile(path):
        return  # absent (made), or a device written in place (/dev/null)
    with open(path, "rb") as fh:
        first = fh.readline(FIRST_LINE_BYTES)
    whole = first.endswith(b"\n")  # else cut short by a full disk: the file's only line
    if first and not (is_record(first) if whole else first.startswith(b'{"event": "')):
        why = "exists and is not an xpnn metrics file (its first line is not an xpnn record)"
        raise UserError(f"`metrics` {path}: {why}; give a new file name, or remove it")


def append_record(path: str | os.PathLike, record: dict[str, Any]) -> None:
    """Append ``record`` as one JSON line, whole or not at all."""
    data = (json.dumps(record, allow_nan=False) + "\n").encode()
    fd = open_to_write(path, os.O_APPEND | os.O_CREAT)
    info = os.fstat(fd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        if stat.S_ISREG(info.st_mode):
            os.ftruncate(fd, info.st_size)
        raise
    finally:
        os.close(fd)


def keep_until(path: str | os.PathLike, epoch: int, step: int | None = None) -> int:
    """Drop the records after ``epoch`` (by steps ``step``) and a line cut short; how many."""
    if not os.path.isfile(path):
        return 0
    lines = Path(path).read_bytes().split(b"\n")
    cut = lines.pop() != b""  # what follows the last newline: a line cut short, or nothing
    kept = [line for line in lines if not _after(line, epoch, step)]
    if dropped := len(lines) - len(kept) + cut:
        with whole_file(path, stat.S_IMODE(os.stat(path).st_mode)) as fh:  # keeps its mode
            fh.write(b"".join(line + b"\n" for line in kept))
    return dropped


def last_event(path: str | os.PathLike) -> str | None:
    """The ``event`` of the file's last record (None: none, or not a record)."""
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as fh:
        fh.seek(max(0, fh.seek(0, os.SEEK_END) - FIRST_LINE_BYTES))
        last = fh.read().rstrip(b"\n").rsplit(b"\n", 1)[-1]
    return json.loads(last)["event"] if last and is_record(last) else None


def _after(line: bytes, epoch: int, step: int | None = None) -> bool:
    record = _parsed(line)
    key = "epoch" if step is None else "step"  # a done record counts them: "epochs", "steps"
    number = record.get(key + "s" if record.get("event") == "done" else key)
    return isinstance(number, int) and number > (epoch if step is None else step)
