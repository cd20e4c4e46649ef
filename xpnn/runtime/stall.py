"""Waiting for other ranks without burning a core, and saying so when they do not come.

MPICH's blocking calls (``Allreduce``, ``Barrier``, ``Wait``) poll at full speed: a rank that
waits for a stopped one (SIGSTOP, a node swapping, a hung file system) sits at 100 % of a core
for as long as the job lasts, without a word. Every wait of xpnn's MPI communicators goes
through ``wait(request, what)`` instead:

* it polls ``Test()`` at full speed for ``SPIN_S``, where small exchanges end;
* then it sleeps ``MIN_NAP_S`` between polls, which costs an exchange under way nothing (MPI
  moves data only when polled, and on the 2-core development VM a 25 MB allreduce between 2
  ranks took as long with 50 us naps between polls as in ``Wait()``, and a third longer
  polled without naps);
* after ``NAP_GROWS_AFTER_S`` the naps grow to ``MAX_NAP_S``: a rank waiting for a stopped
  one uses a few per cent of a core, and a wait that long ends at most 5 ms late;
* after ``stall_warn`` seconds in one wait it prints one line naming the step, the phase and
  the bucket it waits in (once per wait); after ``stall_abort`` seconds the job ends with
  ``STALL_EXIT`` and one line naming the ranks that waited and those they waited for. The
  waiting ranks learn of each other through notes sent on a communicator of their own, so the
  lowest of them speaks for all; the others follow ``ABORT_DEFER_S`` later should it not.

``set_limits`` sets both limits for the process (the command line's ``--stall-warn`` and
``--stall-abort``); ``at_step``, ``in_phase`` and ``in_bucket`` say where the rank is.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

SPIN_S = 0.0005  # polls at full speed first: small exchanges end within this
MIN_NAP_S = 0.00005  # the sleep between polls while an exchange may be under way
NAP_GROWS_AFTER_S = 1.0  # then a wait is most likely for a rank that is not there
MAX_NAP_S = 0.005  # the longest sleep between polls
STALL_WARN_S = 60.0  # as Horovod's stall inspector
STALL_EXIT = 124  # a job ended because a rank stopped answering (as GNU timeout's code)
ABORT_DEFER_S = 2.0  # a waiting rank that is not the lowest waits this much longer
_NOTE_TAG = 77

_limits = {"warn": STALL_WARN_S, "abort": 0.0}
_where: dict[str, Any] = {"phase": "setup", "step": None, "bucket": None}
_state: dict[str, Any] = {"comm": None, "sent": []}


def set_limits(stall_warn: float = STALL_WARN_S, stall_abort: float = 0.0) -> None:
    """Seconds in one wait before a warning (0: never) and before the job is ended (0: never)."""
    for name, value in (("stall_warn", stall_warn), ("stall_abort", stall_abort)):
        if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
            raise ValueError(f"{name}: must be a finite number of seconds >= 0, got {value!r}")
    _limits["warn"], _limits["abort"] = float(stall_warn), float(stall_abort)


def limits() -> tuple[float, float]:
    """(stall_warn, stall_abort) in seconds; 0 is off."""
    return _limits["warn"], _limits["abort"]


def attach(watch_comm: Any) -> None:
    """The communicator (mpi4py, every rank of the job, used for nothing else) on which
    waiting ranks send each other notes and interrupted ranks agree to stop."""
    _state["comm"] = watch_comm


def watch_comm() -> Any:
    """The communicator given to ``attach``, or None (one process, or MPI started elsewhere)."""
    return _state["comm"]


def at_step(step: int) -> None:
    """A training step begins: the phase is its gradient exchange until said otherwise."""
    _where.update(phase="training step", step=step, bucket=None)


def in_phase(phase: str) -> None:
    """What the rank does now, outside a step's gradient exchange (evaluation, checkpoint...)."""
    _where.update(phase=phase, bucket=None)


def in_bucket(index: int, count: int) -> None:
    """The rank waits for bucket ``index`` (from 0) of ``count`` of this step's gradients."""
    _where["bucket"] = (index, count)


def where() -> str:
    """Where the rank is, in words: ``training step 12, bucket 2 of 3``."""
    text = _where["phase"]
    if _where["step"] is not None and text == "training step":
        text += f" {_where['step']}"
    if _where["bucket"] is not None:
        index, count = _where["bucket"]
        text += f", gradient bucket {index + 1} of {count}"
    return text


def wait(request: Any, what: str) -> None:
    """Wait until the MPI ``request`` completes, politely (see the module's docstring)."""
    if request.Test():
        return
    start = time.perf_counter()
    while time.perf_counter() - start < SPIN_S:
        if request.Test():
            return
    _wait_long(request, what, start)


def allgather(mpi_comm: Any, obj: Any, what: str) -> list:
    """mpi4py's ``allgather`` of small objects, with the waiting done in a barrier through
    ``wait`` (MPI has no non-blocking gather of objects): for the setup's few exchanges."""
    wait(mpi_comm.Ibarrier(), what)
    return mpi_comm.allgather(obj)


def _wait_long(request: Any, what: str, start: float) -> None:
    warn, abort = _limits["warn"], _limits["abort"]
    warned = announced = False
    waiting: set[int] = set()
    while True:
        waited = time.perf_counter() - start
        if warn and not warned and waited >= warn:
            warned = True
            _say(f"{_prefix()}has waited {warn:g} s for the others in {what} ({where()})")
        if abort:
            if not announced and waited >= abort / 2:
                announced = True
                _send_notes()
            waiting |= _received_notes()
            if waited >= abort:
                _maybe_abort(what, waited, abort, waiting)
        time.sleep(min(MAX_NAP_S, max(MIN_NAP_S, (waited - NAP_GROWS_AFTER_S) / 10)))
        if request.Test():
            return


def _rank_size() -> tuple[int, int]:
    comm = _state["comm"]
    if comm is not None:
        return comm.Get_rank(), comm.Get_size()
    from mpi4py import MPI  # a request exists, so MPI has started

    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def _prefix() -> str:
    rank, size = _rank_size()
    return f"rank {rank}: " if size > 1 else "xpnn: "


def _send_notes() -> None:
    """Tell every other rank that this one has waited half of ``stall_abort``."""
    comm = _state["comm"]
    if comm is None:
        return
    rank, size = comm.Get_rank(), comm.Get_size()
    for other in range(size):
        if other != rank:  # small: sent eagerly, also to a rank that is stopped
            _state["sent"].append(comm.isend(rank, dest=other, tag=_NOTE_TAG))


def _received_notes() -> set[int]:
    comm = _state["comm"]
    found: set[int] = set()
    while comm is not None and comm.iprobe(tag=_NOTE_TAG):
        found.add(int(comm.recv(tag=_NOTE_TAG)))
    return found


def _maybe_abort(what: str, waited: float, abort: float, others: set[int]) -> None:
    """End the job: at once on the lowest waiting rank that this one knows of, else after
    ``ABORT_DEFER_S`` more (the lowest may be gone or stopped itself)."""
    rank, size = _rank_size()
    waiting = sorted(others | {rank})
    if rank != waiting[0] and waited < abort + ABORT_DEFER_S:
        return
    absent = [r for r in range(size) if r not in waiting]
    _say(stall_line(waiting, absent, abort, f"rank {rank} in {what}, {where()}"))
    from xpnn.runtime.abort import abort_job

    abort_job(STALL_EXIT)


def stall_line(waiting: list[int], absent: list[int], abort: float, detail: str) -> str:
    """The one line that ends a stalled job."""

    def ranks(group: list[int]) -> str:
        return f"rank{'s' if len(group) != 1 else ''} {', '.join(map(str, group))}"

    awaited = f"for {ranks(absent)} " if absent else ""
    return f"xpnn: stalled: {ranks(waiting)} waited {abort:g} s {awaited}({detail}); ending the job"


def _say(line: str) -> None:
    from xpnn.runtime.abort import say

    say(line)


def injected_pause(rank: int, step: int) -> None:
    """``XPNN_SLEEP_AT=RANK:STEP:SECONDS`` (for the stall tests; unset in normal use): that rank
    sleeps before that step, as a rank held up by a slow disk or a busy node would."""
    spec = os.environ.get("XPNN_SLEEP_AT")
    if not spec:
        return
    parts = spec.split(":")
    try:
        at_rank, at_step_, seconds = int(parts[0]), int(parts[1]), float(parts[2])
    except (IndexError, ValueError):
        from xpnn.errors import UserError

        raise UserError(f"XPNN_SLEEP_AT={spec}: expected RANK:STEP:SECONDS, e.g. 1:3:5") from None
    if (at_rank, at_step_) == (rank, step):
        time.sleep(seconds)
