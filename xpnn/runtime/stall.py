"""Waiting for ranks without burning a core as MPICH's blocking calls do; a stall ends the job."""

import math
import os
import time
from array import array
from itertools import accumulate
from typing import Any

from xpnn.runtime import flight
from xpnn.runtime.interrupts import abort_job, mpi_rank_size, prefix, say

SPIN_S = 0.0005  # polls at full speed first: small exchanges end within this
YIELD_S = 0.25  # then polls yielding the core, no naps: MPI moves a message only when polled
MIN_NAP_S = 0.00005  # the sleep between polls once the exchange outlasted YIELD_S
NAP_GROWS_AFTER_S = 1.0  # then a wait is most likely for a rank that is not there
MAX_NAP_S = 0.005  # the longest sleep between polls
STALL_WARN_S = 60.0  # as Horovod's stall inspector
STALL_EXIT = 124  # a job ended because a rank stopped answering (as GNU timeout's code)
_NOTE_TAG = 77

# comm: a communicator used for nothing else, of waiting ranks' notes and of stopping (init_world)
STATE: dict[str, Any] = {"warn": STALL_WARN_S, "abort": 0.0, "comm": None, "sent": []}
STATE.update(phase="setup", step=None, bucket=None)  # where this rank is: ``where``


def set_limits(stall_warn: float = STALL_WARN_S, stall_abort: float = 0.0) -> None:
    """Seconds in one wait before a warning and before the job is ended (0: never)."""
    for name, value in (("stall_warn", stall_warn), ("stall_abort", stall_abort)):
        if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
            raise ValueError(f"{name}: must be a finite number of seconds >= 0, got {value!r}")
    STATE["warn"], STATE["abort"] = float(stall_warn), float(stall_abort)


def limits() -> tuple[float, float]:
    return STATE["warn"], STATE["abort"]


def stopped_together() -> bool:
    comm = STATE["comm"]  # did every rank hear of the stop too, within a second?
    return comm is not None and done_within(comm.Ibarrier(), 1.0, 0.002)


def done_within(request: Any, seconds: float, nap: float) -> bool:
    deadline = time.monotonic() + seconds
    while not request.Test():
        if time.monotonic() > deadline:
            return False
        time.sleep(nap)
    return True


def at_step(step: int) -> None:
    STATE.update(phase="training step", step=step, bucket=None)
    flight.TAGS["step"] = step


def in_phase(phase: str) -> None:
    STATE.update(phase=phase, bucket=None)


def in_bucket(index: int, count: int) -> None:
    STATE["bucket"] = (index, count)


def where() -> str:
    """``training step 12, gradient bucket 2 of 3``."""
    text = STATE["phase"]
    if STATE["step"] is not None and text == "training step":
        text += f" {STATE['step']}"
    if STATE["bucket"] is not None:
        index, count = STATE["bucket"]
        text += f", gradient bucket {index + 1} of {count}"
    return text


def wait(request: Any, what: str) -> None:
    if request.Test():
        return
    start = time.perf_counter()
    while time.perf_counter() - start < SPIN_S:
        if request.Test():
            return
    while time.perf_counter() - start < YIELD_S:
        os.sched_yield()
        if request.Test():
            return
    _wait_long(request, what, start)


def allgather(mpi_comm: Any, obj: Any, what: str) -> list:
    """``allgather`` of objects, each exchange polled by ``wait``, without NumPy."""
    from mpi4py import MPI

    mine = MPI.pickle.dumps(obj)
    sizes = array("q", [0] * mpi_comm.Get_size())
    wait(mpi_comm.Iallgather([array("q", [len(mine)]), MPI.INT64_T], [sizes, MPI.INT64_T]), what)
    counts = list(sizes)
    starts = [0, *accumulate(counts)][:-1]
    everyone = bytearray(sum(counts))
    wait(mpi_comm.Iallgatherv([mine, MPI.BYTE], [everyone, (counts, starts), MPI.BYTE]), what)
    pieces = zip(starts, counts, strict=True)
    return [MPI.pickle.loads(bytes(everyone[a : a + n])) for a, n in pieces]


def _wait_long(request: Any, what: str, start: float) -> None:
    warn, abort, comm = STATE["warn"], STATE["abort"], STATE["comm"]
    warned = announced = False
    waiting: dict[int, Any] = {}  # rank -> where it waits (``flight.position``)
    while True:
        waited = time.perf_counter() - start
        if warn and not warned and waited >= warn:
            warned = True
            flight.dump(f"waited {warn:g} s in {what}", temporary=True)
            who = prefix(*mpi_rank_size())
            say(f"{who}has waited {warn:g} s for the others in {what} ({where()})")
        if abort:
            if not announced and waited >= abort / 2:
                announced = True
                flight.dump(f"waited {abort / 2:g} s in {what}: the job may be ended", True)
                if comm is not None:  # tell every other rank that this one waits, and where
                    note, others = (comm.Get_rank(), flight.position()), range(comm.Get_size())
                    sent = [comm.isend(note, dest=r, tag=_NOTE_TAG) for r in others if r != note[0]]
                    STATE["sent"] += sent  # small: sent eagerly, also to a rank that is stopped
            while comm is not None and comm.iprobe(tag=_NOTE_TAG):
                sender, position = comm.recv(tag=_NOTE_TAG)
                waiting[int(sender)] = position
            if waited >= abort:
                _maybe_abort(what, waited, abort, waiting)
        time.sleep(min(MAX_NAP_S, max(MIN_NAP_S, (waited - NAP_GROWS_AFTER_S) / 10)))
        if request.Test():
            return


def _maybe_abort(what: str, waited: float, abort: float, others: dict[int, Any]) -> None:
    """End the job: the lowest waiting rank at once, the others 2 s later."""
    rank, size = mpi_rank_size()
    positions = {**others, rank: flight.position()}
    waiting = sorted(positions)
    if rank != waiting[0] and waited < abort + 2.0:
        return
    absent = [r for r in range(size) if r not in waiting]
    flight.dump(f"ended the job after {abort:g} s in {what}", temporary=True)
    account = flight.describe(positions, absent, flight.dump_pattern())
    say(stall_line(waiting, absent, abort, f"rank {rank} in {what}, {where()}", account))
    abort_job(STALL_EXIT)


def stall_line(
    waiting: list[int], absent: list[int], abort: float, detail: str, account: str = ""
) -> str:
    """``account``: the flight recorder's (who never entered which operation, the dumps)."""
    awaited = f"for {flight.rank_list(absent)} " if absent else ""
    account = f": {account}" if account else ""
    return (
        f"xpnn: stalled: {flight.rank_list(waiting)} waited {abort:g} s {awaited}({detail})"
        f"{account}; ending the job"
    )
