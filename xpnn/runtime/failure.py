"""Failing well on many ranks: one clear line, the right exit code, no hung job.

Two phases, two tools:

* ``agree_on_user_errors(comm, fn)`` -- the **setup** phase (argument checks, reading and
  validating data, building the model). Every rank runs ``fn``; what went wrong is gathered;
  rank 0 prints it once; every rank leaves together with the same code (2 for a UserError, 1
  for a bug) by raising ``CollectiveExit``, without MPI_Abort. The agreement runs on its own
  communicator; a rank that failed waits for the others at most ``XPNN_AGREE_TIMEOUT``
  seconds (60): if some rank is stuck in a collective inside ``fn`` that the failed rank
  skipped, it prints its own line and aborts the job instead of hanging. Best keep ``fn``
  free of collectives anyway (build the communicator in a second agreement).
* ``run_guarded(comm, fn)`` -- wraps the whole program, and so the **training** phase where
  ranks communicate every step. Any exception is printed with its rank (``rank R: Type:
  message``) and, with more than one rank, ends the job through ``MPI_Abort``: a rank that
  just exited would leave the others blocked in their next allreduce forever (MPICH's
  hydra does not notice a rank leaving through exit() while the others wait in a
  collective; it does clean up after a rank killed by a signal).

Typical CLI::

    def main() -> int:
        world = init_world()
        return run_guarded(world, lambda: _main(world))

    def _main(world):
        cfg, data = agree_on_user_errors(world, lambda: setup(args, world))
        train(cfg, data, world)
"""

from __future__ import annotations

import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

from xpnn.errors import UserError, user_message
from xpnn.runtime.abort import abort_job, say

T = TypeVar("T")


class CollectiveExit(SystemExit):
    """Every rank is leaving with this code together; no abort is needed."""


def _rank_size(world_or_comm: Any) -> tuple[int, int]:
    if world_or_comm is None:
        return 0, 1
    return int(world_or_comm.rank), int(world_or_comm.size)


def one_line(text: str) -> str:
    """Messages must stay on one line on stderr, whatever the exception put in them."""
    return " | ".join(part.strip() for part in str(text).splitlines() if part.strip())


def describe(exc: BaseException) -> str:
    """``Type: message`` on one line (just ``Type`` when the message is empty)."""
    msg = one_line(str(exc))
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def _debug() -> bool:
    return os.environ.get("XPNN_DEBUG", "") not in ("", "0")


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    say(one_line(str(exc.code)))
    return 1


SIGPIPE_EXIT = 141  # what a shell shows for a program that SIGPIPE ended (128 + 13)
SIGTERM_EXIT = 143  # ... and SIGTERM (128 + 15)


class Terminated(BaseException):
    """SIGTERM arrived (Slurm's time limit, ``scancel``, ``kill``): the run stops as it does
    on Ctrl-C, so that a file being written is finished or removed and every rank stops."""


def terminate_on_sigterm() -> None:
    """Raise ``Terminated`` in the main thread on SIGTERM (the command line's choice: a
    program that uses xpnn as a library keeps its own handlers). Without it SIGTERM ends the
    process at once, with no message, possibly half-way through writing a checkpoint."""
    import signal

    def handler(signum: int, frame: Any) -> None:
        raise Terminated

    signal.signal(signal.SIGTERM, handler)


STOP_GRACE_S = 10.0  # after SIGTERM or Ctrl-C, how long a rank may take to stop by itself


def stop_grace() -> float:
    """``XPNN_STOP_GRACE`` seconds, else ``STOP_GRACE_S``."""
    return _seconds("XPNN_STOP_GRACE", STOP_GRACE_S)


def _seconds(var: str, default: float) -> float:
    """The environment's ``var``: finite seconds >= 0, else a UserError naming it."""
    text = os.environ.get(var, "").strip()
    try:
        value = float(text) if text else default
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):  # -5 or inf: the watch thread's sleep failed
        raise UserError(f"{var}={text}: expected a number of seconds >= 0")
    return value


def stop_when_stuck(grace: float) -> None:
    """After SIGTERM or Ctrl-C, end the job if this rank has not stopped ``grace`` s later.

    Python runs a signal's handler between bytecodes only, so a rank blocked in an MPI call
    that never returns (another rank stopped, or gone without the launcher noticing) would
    ignore both, and ``timeout`` or ``kill`` would leave the job running. The signal also
    wakes a thread (``signal.set_wakeup_fd``), which waits ``grace`` seconds and then says so
    and aborts the job (or exits, without MPI). Call it from the main thread."""
    import signal
    import threading

    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)

    def watch() -> None:
        while True:
            signum = os.read(read_end, 1)[0]
            if signum in (signal.SIGTERM, signal.SIGINT):
                break
        time.sleep(grace)
        what = "terminated (SIGTERM)" if signum == signal.SIGTERM else "interrupted"
        code = SIGTERM_EXIT if signum == signal.SIGTERM else 130
        rank, size = _mpi_rank_size()
        prefix = f"rank {rank}: " if size > 1 else "xpnn: "
        say(
            f"{prefix}{what}, and still not stopped after {grace:g} s (blocked in a call "
            "that does not return, such as MPI waiting for a rank that does not answer): "
            "ending the job"
        )
        if size > 1:
            from mpi4py import MPI

            MPI.COMM_WORLD.Abort(code)
        os._exit(code)

    threading.Thread(target=watch, name="xpnn-stop-watch", daemon=True).start()


def _mpi_rank_size() -> tuple[int, int]:
    """The job's rank and size where MPI has started, else (0, 1); never starts MPI."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return 0, 1
    return mpi.COMM_WORLD.Get_rank(), mpi.COMM_WORLD.Get_size()


def silence_stdout() -> None:
    """Point stdout at /dev/null, so that the flush at exit does not fail on the closed pipe
    a second time (Python's own advice for BrokenPipeError)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real stdout to redirect
        pass


def stopped_from_outside(exc: BaseException) -> tuple[str, int] | None:
    """(what to say, exit code) when ``exc`` means the run was stopped from outside rather
    than failed: stdout's reader left (``| head``; stdout is silenced), SIGTERM, Ctrl-C. None
    for anything else. The command line and the benchmarks say these the same way."""
    if isinstance(exc, BrokenPipeError):
        silence_stdout()
        return "stdout was closed (broken pipe): stopped", SIGPIPE_EXIT
    if isinstance(exc, Terminated):
        return "terminated (SIGTERM)", SIGTERM_EXIT
    if isinstance(exc, KeyboardInterrupt):  # Ctrl-C, or mpiexec passing it on
        return "interrupted", 130
    return None


def run_guarded(world_or_comm: Any, fn: Callable[[], Any]) -> int:
    """Run ``fn()`` and turn its outcome into an exit code; never leave other ranks hanging.

    ``fn`` returning None or an int gives 0 or that int. A UserError: one stderr line, exit 2
    (``xpnn: message`` alone, ``rank R: message`` with several ranks). Any other exception:
    ``rank R: Type: message`` (full traceback only with ``XPNN_DEBUG=1``), exit 1; Ctrl-C:
    ``interrupted``, exit 130; stdout closed under us (``| head``): exit 141; ``Terminated``
    (SIGTERM): exit 143. With more
    than one rank a failure calls MPI_Abort with that code instead of returning, so every rank
    stops within seconds. ``CollectiveExit`` (every rank leaving together) is just returned.
    """
    rank, size = _rank_size(world_or_comm)
    try:
        from xpnn.interrupts import hand_over

        hand_over(Terminated)  # a signal noted while MPI started is raised here
        result = fn()
    except CollectiveExit as exc:
        return _exit_code(exc)
    except SystemExit as exc:
        code = _exit_code(exc)
        if code != 0 and size > 1:
            abort_job(code)
        return code
    except UserError as exc:
        prefix = f"rank {rank}: " if size > 1 else "xpnn: "
        say(prefix + one_line(user_message(exc)))
        code = int(getattr(exc, "exit_code", 2))
        if size > 1:
            abort_job(code)
        return code
    except BaseException as exc:  # noqa: B036 -- KeyboardInterrupt too: others must stop
        if _debug():
            traceback.print_exc()
        prefix = f"rank {rank}: " if size > 1 else "xpnn: "
        message, code = stopped_from_outside(exc) or (describe(exc), 1)
        if isinstance(exc, KeyboardInterrupt | Terminated):
            _calm_further_signals()
        if size > 1 and isinstance(exc, KeyboardInterrupt | Terminated) and stopped_together():
            if rank == 0:  # every rank was told (mpiexec passes signals on): one line for all
                say(f"xpnn: {message}")
            sys.stdout.flush()
            # the others leave once rank 0 has said it: the launcher may end a rank that is
            # still running when another leaves, and with it a line not yet written
            stopped_together()
            os._exit(code)  # no MPI_Abort: nothing more to stop, and no launcher banner
        say(prefix + message)
        if size > 1:
            abort_job(code)
        return code
    if result is None:
        return 0
    if isinstance(result, bool) or not isinstance(result, int):
        return 0
    return result


def _calm_further_signals() -> None:
    """A second Ctrl-C (people press it again when the first seems slow) must not cut the
    stopping short with a traceback: from now on SIGINT and SIGTERM only wake the watch of
    ``stop_when_stuck``, which ends the job should this rank not stop by itself."""
    import signal

    try:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: None)
    except ValueError:  # not the main thread: signals are not this code's to handle
        pass


STOP_TOGETHER_S = 1.0  # how long an interrupted rank waits to hear that all others were too


def stopped_together(within: float = STOP_TOGETHER_S) -> bool:
    """Whether every rank reaches this call within ``within`` seconds of this one: a Ctrl-C or
    SIGTERM given to ``mpiexec`` reaches every rank at once, and then each may simply exit
    (``mpiexec`` then exits with the same code, silently); a signal that reached some ranks
    only must end the others through MPI_Abort. Runs on the stall watch's communicator, which
    carries no other collective, whatever collective the interrupt cut short."""
    from xpnn.runtime import stall

    comm = stall.watch_comm()
    if comm is None:
        return False
    request = comm.Ibarrier()
    deadline = time.monotonic() + within
    while not request.Test():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def agree_timeout() -> float:
    """Seconds a failed rank waits for the others in ``agree_on_user_errors``."""
    return _seconds("XPNN_AGREE_TIMEOUT", 60.0)


def _gather_codes(size: int, code: int) -> Any:
    """Every rank's exit code (0: fine) on the control communicator, or None on timeout.

    Ranks that succeeded wait as long as it takes (others may still be loading data); a rank
    that failed polls and gives up after ``agree_timeout()``.
    """
    import numpy as np

    from xpnn.runtime.world import control_comm

    comm: Any = control_comm()
    mine = np.array([code], dtype=np.int32)
    codes = np.zeros(size, dtype=np.int32)
    req = comm.Iallgather(mine, codes)
    if code == 0:
        from xpnn.runtime import stall

        stall.wait(req, "the agreement that setup succeeded")
        return codes
    deadline = time.monotonic() + agree_timeout()
    while not req.Test():
        if time.monotonic() > deadline:
            return None
        time.sleep(0.005)
    return codes


def agree_on_user_errors(world_or_comm: Any, fn: Callable[[], T]) -> T:
    """Run the rank-local setup ``fn`` on every rank, then agree on whether to go on.

    Returns ``fn()``'s value when every rank succeeded. Otherwise rank 0 prints one line on
    stderr and every rank raises ``CollectiveExit`` with the same code (a failed rank that
    waited ``XPNN_AGREE_TIMEOUT`` s for the others prints its own line and aborts): 1 if any
    rank hit a bug (an exception other than UserError), else 2 for a UserError (else the code of a
    SystemExit, e.g. from argparse, which printed its own message). The line is the message
    alone when every rank failed with the same message (``xpnn: message``), else it names the
    first failing rank (``xpnn: rank R: message``), plus how many others failed.
    """
    rank, size = _rank_size(world_or_comm)
    outcome: tuple[str, int, str] | None = None
    result: Any = None
    if size > 1:  # where a rank that stopped is waited for politely (collectives inside fn
        from xpnn.runtime import stall  # would wait in MPI's own spinning calls)
        from xpnn.runtime.world import control_comm

        stall.wait(control_comm().Ibarrier(), "the barrier before a setup phase")  # type: ignore[attr-defined]
    try:
        result = fn()
    except UserError as exc:
        outcome = ("user", int(getattr(exc, "exit_code", 2)), one_line(user_message(exc)))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if code:
            outcome = ("exit", code, "")
    except Exception as exc:
        if _debug():
            traceback.print_exc()
        outcome = ("bug", 1, describe(exc))

    if size > 1:
        codes = _gather_codes(size, outcome[1] if outcome else 0)
        if codes is None:  # the others never came: some rank is stuck inside fn
            kind, code, message = outcome  # type: ignore[misc]
            if message:
                say(f"rank {rank}: {message}")
            abort_job(code)
        if not any(codes):
            return result
        from xpnn.runtime.world import control_comm

        outcomes = control_comm().allgather(outcome)  # type: ignore[attr-defined]
    else:
        outcomes = [outcome]
    failed = [(r, o) for r, o in enumerate(outcomes) if o is not None]
    if not failed:
        return result

    for severity in ("bug", "user", "exit"):
        chosen = [(r, o) for r, o in failed if o[0] == severity]
        if chosen:
            break
    first_rank, (kind, code, message) = chosen[0]
    if rank == 0 and message:
        everyone_same = len(failed) == size and all(o == chosen[0][1] for _, o in failed)
        if everyone_same or size == 1:
            line = f"xpnn: {message}"
        else:
            others = len(failed) - 1
            more = f" (and {others} more rank{'s' if others != 1 else ''})" if others else ""
            line = f"xpnn: rank {first_rank}: {message}{more}"
        say(line)
    raise CollectiveExit(code)
