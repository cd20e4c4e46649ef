"""The flight recorder: every rank keeps its last ``RING`` collective and point-to-point
operations (sequence number per communicator, operation, bytes, bucket or micro-batch, step,
post, wait and end times), always on; the stall watch and a failing rank dump it as JSON, and
the stall line compares where every rank waits. A finished operation also goes to the timeline
tracer (``xpnn.record.phases.trace_to``) while one listens."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections import deque
from typing import Any

from xpnn.record import phases
from xpnn.record.files import replace_whole

RING = 512  # operations kept per rank: a few steps of a pipeline's sends and receives

_now = time.perf_counter


class Record:
    """One operation; ``end`` is None while it has not been seen to finish."""

    __slots__ = ("seq", "op", "nbytes", "peer", "bucket", "microbatch", "step", "start")
    __slots__ += ("posted", "wait", "end", "group")

    def __init__(self, seq: int, op: str, nbytes: int, peer: int | None, group: str) -> None:
        self.seq, self.op, self.nbytes, self.peer, self.group = seq, op, nbytes, peer, group
        self.bucket, self.microbatch = _tags["bucket"], _tags["microbatch"]
        self.step = _tags["step"]
        self.start = _now()
        self.posted: float | None = None  # when the non-blocking call returned
        self.wait: float | None = None
        self.end: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}

    def name(self) -> str:
        """``allreduce #812 (bucket 3, step 406)``: how the stall line and the trace say it."""
        peer = f" {'to' if self.op == 'send' else 'from'} rank {self.peer}"
        where = [f"{_size(self.nbytes)}"] if self.nbytes else []
        if self.bucket is not None:
            where.append(f"bucket {self.bucket}")
        if self.microbatch is not None:
            where.append(f"micro-batch {self.microbatch}")
        if self.step is not None:
            where.append(f"step {self.step}")
        return f"{self.op} #{self.seq}{peer if self.peer is not None else ''}" + (
            f" ({', '.join(where)})" if where else ""
        )


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


_ring: deque[Record] = deque(maxlen=RING)
_tags: dict[str, Any] = {"bucket": None, "microbatch": None, "step": None}
_state: dict[str, Any] = {"current": None, "dir": None, "rank": 0, "dumped": None, "temp": None}


def at_step(step: int | None) -> None:
    _tags["step"] = step


def tag(bucket: int | None = None, microbatch: int | None = None) -> None:
    """What the operations posted from here on belong to (None: nothing)."""
    _tags["bucket"], _tags["microbatch"] = bucket, microbatch


def _group(comm: Any) -> str:
    """Which communicator: its size and this rank in it (a sequence number counts per group)."""
    return f"{comm.size} ranks" if comm.size > 1 else "1 rank"


def post(comm: Any, op: str, nbytes: int = 0, peer: int | None = None) -> Record:
    """``op`` is handed to the transport now; numbered in ``comm``'s own sequence."""
    own = comm.__dict__
    seq = own.get("_flight_seq", 0) + 1
    comm._flight_seq = seq
    group = own.get("_flight_group") or own.setdefault("_flight_group", _group(comm))
    record = Record(seq, op, nbytes, peer, group)
    _ring.append(record)
    return record


def waiting(record: Record) -> None:
    """This rank waits for ``record`` to finish: what it says when it stalls."""
    record.wait = _now()
    _state["current"] = record


def done(record: Record) -> None:
    record.end = _now()
    if record.wait is None:
        record.wait = record.end
    _state["current"] = None
    tracer = phases.tracer()
    if tracer is not None:
        tracer.operation(record)


class Op:
    """``with Op(comm, "allreduce", nbytes):`` a blocking operation, posted and waited for."""

    __slots__ = ("record",)

    def __init__(self, comm: Any, op: str, nbytes: int = 0, peer: int | None = None) -> None:
        self.record = post(comm, op, nbytes, peer)

    def __enter__(self) -> Record:
        waiting(self.record)
        return self.record

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            done(self.record)


class Tracked:
    """A communicator's ``Handle`` with its record: the wait is recorded."""

    __slots__ = ("handle", "record")

    def __init__(self, handle: Any, record: Record) -> None:
        self.handle, self.record = handle, record
        record.posted = _now()

    def wait(self) -> None:
        record = self.record
        if record is None:
            self.handle.wait()
            return
        waiting(record)
        self.handle.wait()
        done(record)
        self.record = None


def current() -> Record | None:
    """The operation this rank waits in, if it waits."""
    return _state["current"]


def records() -> list[Record]:
    return list(_ring)


def clear() -> None:
    _ring.clear()
    _state["current"] = None


def dump_to(directory: str | None, rank: int) -> None:
    """Where ``dump`` writes ``flight-rank{rank}.json`` (None: nowhere)."""
    _state["dir"], _state["rank"] = directory, rank


def dump_pattern() -> str | None:
    """``ck/flight-rank*.json``: what the stall line names, or None when nothing is dumped.
    Records in temporary directories: every rank's of this job on this node (they share the
    launcher's process as their parent)."""
    directory = _state["dir"]
    if directory is None and _state["temp"] is not None:
        return os.path.join(tempfile.gettempdir(), f"{_temp_prefix()}*", "flight-rank*.json")
    return None if directory is None else os.path.join(directory, "flight-rank*.json")


def _temp_prefix() -> str:
    return f"xpnn-flight-{os.getppid()}-"


def _temporary_directory() -> str:
    """This rank's own new directory for a run without one (``mkdtemp``: mode 0700, a name
    nobody could have planted), made on its first dump only."""
    if _state["temp"] is None:
        _state["temp"] = tempfile.mkdtemp(prefix=_temp_prefix())
        from xpnn.runtime.mpi_state import imported_mpi

        mpi = imported_mpi()  # the rank is not known otherwise: no dump_to
        if mpi is not None and mpi.Is_initialized():
            _state["rank"] = mpi.COMM_WORLD.Get_rank()
    return _state["temp"]


def dump(reason: str, temporary: bool = False) -> str | None:
    """Write the ring as JSON (``reason``: why); the path, or None (no directory, or it failed:
    a dump must never hide the stall or failure that asked for it). ``temporary``: where the
    run has no directory of its own, into a temporary one (a stall's records)."""
    directory = _state["dir"]
    if directory is None and temporary:
        try:
            directory = _temporary_directory()
        except OSError:
            return None
    if directory is None:
        return None
    path = os.path.join(directory, f"flight-rank{_state['rank']}.json")
    current_record = _state["current"]
    doc = {
        "rank": _state["rank"],
        "reason": reason,
        "clock": "time.perf_counter seconds",
        "now": _now(),
        "waiting_in": current_record.as_dict() if current_record is not None else None,
        "operations": [r.as_dict() for r in _ring],
    }
    try:
        os.makedirs(directory, exist_ok=True)
        replace_whole(path, json.dumps(doc, indent=0).encode())  # never through a link
    except OSError:
        return None
    _state["dumped"] = path
    return path


def position() -> dict[str, Any] | None:
    """Where this rank waits, small enough for a note to the others: None when it does not."""
    record = _state["current"]
    if record is None:
        return None
    keys = ("group", "seq", "op", "nbytes", "peer", "bucket", "microbatch", "step")
    return {key: getattr(record, key) for key in keys}


def describe(
    positions: dict[int, dict[str, Any] | None], absent: list[int], dumped: str | None
) -> str:
    """The stall line's account: who never entered which operation, who waits in it, or a
    mismatch between the waiting ranks; and where the flight records are."""
    waiting = {rank: p for rank, p in positions.items() if p is not None}
    parts: list[str] = []
    if waiting:
        keys = {(p["group"], p["seq"]) for p in waiting.values()}
        kinds = {(p["op"], p["nbytes"]) for p in waiting.values()}
        names = {rank: _name(p) for rank, p in waiting.items()}
        collective = all(p["peer"] is None for p in waiting.values())
        if collective and len(keys) == 1 and len(kinds) == 1:
            name = next(iter(names.values()))
            if absent:
                parts.append(f"{_ranks(absent)} never entered {name} or stopped in it")
            verb = "waits" if len(waiting) == 1 else "wait"
            parts.append(f"{_ranks(sorted(waiting))} {verb} in it")
        elif collective and len(keys) == 1:
            parts.append(
                "mismatch: the same operation number with different operations or sizes ("
                + "; ".join(f"rank {r} in {n}" for r, n in sorted(names.items()))
                + ")"
            )
        else:
            mixed = collective and len({p["group"] for p in waiting.values()}) == 1
            each = "; ".join(f"rank {r} waits in {n}" for r, n in sorted(names.items()))
            parts.append(f"mismatch: ranks in different operations ({each})" if mixed else each)
            if absent:
                parts.append(f"{_ranks(absent)} did not answer")
    if dumped:
        parts.append(f"flight records in {dumped}")
    return "; ".join(parts)


def _name(position: dict[str, Any]) -> str:
    record = Record.__new__(Record)
    for key in Record.__slots__:
        setattr(record, key, position.get(key))
    return record.name()


def _ranks(group: list[int]) -> str:
    return f"rank{'s' if len(group) != 1 else ''} {', '.join(map(str, group))}"
