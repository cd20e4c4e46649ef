"""The flight recorder: each rank's last ``RING`` operations, for stall lines, dumps and traces."""

import contextlib
import json
import os
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

from xpnn.record import phases
from xpnn.record.files import replace_whole
from xpnn.runtime.interrupts import mpi_rank_size

RING = 512  # operations kept per rank: a few steps of a pipeline's sends and receives
_ring: "deque[Record]" = deque(maxlen=RING)
TAGS: dict[str, Any] = {"bucket": None, "microbatch": None, "step": None}  # of the next posts
_state: dict[str, Any] = {"current": None, "dir": None, "rank": 0, "temp": None}
_now = time.perf_counter
_POSITION = ("group", "seq", "op", "nbytes", "peer", "bucket", "microbatch", "step")  # ``position``


class Record:
    """One operation; ``end`` is None until it is seen to finish."""

    __slots__ = (*_POSITION, "start", "posted", "wait", "end")

    def __init__(self, seq: int, op: str, nbytes: int, peer: int | None, group: str) -> None:
        self.seq, self.op, self.nbytes, self.peer, self.group = seq, op, nbytes, peer, group
        self.bucket, self.microbatch = TAGS["bucket"], TAGS["microbatch"]
        self.step, self.start = TAGS["step"], _now()
        self.posted = self.wait = self.end = None  # times once seen (posted: the call returned)

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}

    def name(self: Any) -> str:  # a Record, or a ``position`` as a namespace
        """``allreduce #812 (bucket 3, step 406)``."""
        to = "to" if self.op == "send" else "from"
        peer = "" if self.peer is None else f" {to} rank {self.peer}"
        where = [_size(self.nbytes)] if self.nbytes else []
        tags = (("bucket", self.bucket), ("micro-batch", self.microbatch), ("step", self.step))
        where += [f"{word} {value}" for word, value in tags if value is not None]
        return f"{self.op} #{self.seq}{peer}" + (f" ({', '.join(where)})" if where else "")


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def tag(bucket: int | None = None, microbatch: int | None = None) -> None:
    """What the operations posted from here on belong to."""
    TAGS["bucket"], TAGS["microbatch"] = bucket, microbatch


def post(comm: Any, op: str, nbytes: int = 0, peer: int | None = None) -> Record:
    """``op`` is handed to the transport now; numbered in ``comm``'s own sequence."""
    own = comm.__dict__
    own["_flight_seq"] = seq = own.get("_flight_seq", 0) + 1
    group = own.get("_flight_group") or own.setdefault(
        "_flight_group", f"{comm.size} ranks" if comm.size > 1 else "1 rank"
    )
    record = Record(seq, op, nbytes, peer, group)
    _ring.append(record)
    return record


def waiting(record: Record) -> None:
    record.wait = _now()
    _state["current"] = record


def done(record: Record) -> None:
    record.end = _now()  # after ``waiting``, which set ``wait``
    _state["current"] = None
    if (tracer := phases.tracer()) is not None:
        tracer.operation(record)


@contextlib.contextmanager
def Op(comm: Any, op: str, nbytes: int = 0, peer: int | None = None) -> Iterator[Record]:
    """``with Op(comm, "allreduce", nbytes):`` a blocking operation, posted and waited for."""
    record = post(comm, op, nbytes, peer)
    waiting(record)
    yield record
    done(record)


class Tracked:
    """A communicator's ``Handle`` whose wait is recorded."""

    __slots__ = ("handle", "record")

    def __init__(self, handle: Any, record: Record) -> None:
        self.handle, self.record = handle, record
        record.posted = _now()

    def wait(self) -> None:
        record, self.record = self.record, None  # a second wait records nothing
        if record is not None:
            waiting(record)
        self.handle.wait()
        if record is not None:
            done(record)


def clear() -> None:
    _ring.clear()
    _state["current"] = None


def dump_to(directory: str | None, rank: int) -> None:
    """Where ``dump`` writes ``flight-rank{rank}.json`` (None: nowhere)."""
    _state["dir"], _state["rank"] = directory, rank


def dump_pattern() -> str | None:
    """``ck/flight-rank*.json``: where the stall line says the dumps are."""
    directory = _state["dir"]
    if directory is None and _state["temp"] is not None:
        return os.path.join(tempfile.gettempdir(), f"{_temp_prefix()}*", "flight-rank*.json")
    return None if directory is None else os.path.join(directory, "flight-rank*.json")


def _temp_prefix() -> str:
    return f"xpnn-flight-{os.getppid()}-"


def dump(reason: str, temporary: bool = False) -> str | None:
    """The ring as JSON in the run's directory (``temporary``: else a new temporary one)."""
    directory, current, now = _state["dir"], _state["current"], _now()
    try:
        if directory is None and temporary and _state["temp"] is None:
            _state["temp"] = tempfile.mkdtemp(prefix=_temp_prefix())  # 0700, a new name
            _state["rank"] = mpi_rank_size()[0]  # the rank is not known otherwise: no dump_to
        if directory is None and temporary:
            directory = _state["temp"]
        if directory is None:
            return None
        doc = dict(rank=_state["rank"], reason=reason, clock="time.perf_counter seconds", now=now)
        doc["waiting_in"] = current.as_dict() if current is not None else None
        doc["operations"] = [r.as_dict() for r in _ring]
        path = os.path.join(directory, f"flight-rank{_state['rank']}.json")
        os.makedirs(directory, exist_ok=True)
        replace_whole(path, json.dumps(doc, indent=0).encode())  # never through a link
    except OSError:
        return None
    return path


def position() -> dict[str, Any] | None:
    """Where this rank waits, small enough for a note to the others; None when it does not."""
    record = _state["current"]
    return None if record is None else {key: getattr(record, key) for key in _POSITION}


def describe(
    positions: dict[int, dict[str, Any] | None], absent: list[int], dumped: str | None
) -> str:
    """The stall line's account of where the ranks wait, and where the flight records are."""
    waiting = {rank: p for rank, p in positions.items() if p is not None}
    parts: list[str] = []
    if waiting:
        keys = {(p["group"], p["seq"]) for p in waiting.values()}
        kinds = {(p["op"], p["nbytes"]) for p in waiting.values()}
        names = {rank: Record.name(SimpleNamespace(**p)) for rank, p in waiting.items()}
        collective = all(p["peer"] is None for p in waiting.values())
        if collective and len(keys) == 1 and len(kinds) == 1:
            name = next(iter(names.values()))
            if absent:
                parts.append(f"{rank_list(absent)} never entered {name} or stopped in it")
            verb = "waits" if len(waiting) == 1 else "wait"
            parts.append(f"{rank_list(sorted(waiting))} {verb} in it")
        elif collective and len(keys) == 1:
            each = "; ".join(f"rank {r} in {n}" for r, n in sorted(names.items()))
            same = "the same operation number with different operations or sizes"
            parts.append(f"mismatch: {same} ({each})")
        else:
            mixed = collective and len({p["group"] for p in waiting.values()}) == 1
            each = "; ".join(f"rank {r} waits in {n}" for r, n in sorted(names.items()))
            parts.append(f"mismatch: ranks in different operations ({each})" if mixed else each)
            if absent:
                parts.append(f"{rank_list(absent)} did not answer")
    if dumped:
        parts.append(f"flight records in {dumped}")
    return "; ".join(parts)


def rank_list(group: list[int]) -> str:
    """``rank 3`` or ``ranks 1, 2``."""
    return f"rank{'s' if len(group) != 1 else ''} {', '.join(map(str, group))}"
