"""Failing well on many ranks: one clear line, the right exit code, no hung job. Setup runs in
``agree_on_user_errors`` (every rank leaves together); ``run_guarded`` ends the job through
MPI_Abort, since hydra does not notice a rank that exits while the others wait in a collective.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

from xpnn.errors import UserError, user_message
from xpnn.runtime import flight, stall
from xpnn.runtime.abort import abort_job, prefix, say
from xpnn.runtime.mpi_state import imported_mpi
from xpnn.runtime.world import control_comm, in_mpi_init, launch_rank

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


# What ends a run as Ctrl-C does, each with exit 128 + its number: Slurm's time limit and
# scancel (TERM), a closed terminal or ssh connection (HUP), Ctrl-\\ (QUIT), a CPU-time limit (XCPU)
STOP_NAMES = ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGXCPU")
STOP_SIGNALS = tuple(getattr(signal, name) for name in STOP_NAMES if hasattr(signal, name))


class Terminated(BaseException):
    """A stop signal arrived (``STOP_SIGNALS``): stop as on Ctrl-C."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def words(self) -> str:
        return f"terminated ({signal.Signals(self.signum).name})"


def terminate_on_sigterm() -> None:
    """Raise ``Terminated`` on every stop signal, so a file being written is finished or
    removed (after MPI_Init: a library's own handler, UCX's for SIGHUP, is replaced). The
    command line's choice: a program using xpnn as a library keeps its own handlers."""

    def handler(signum: int, frame: Any) -> None:
        raise Terminated(signum)

    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) != signal.SIG_IGN:  # nohup's SIGHUP stays ignored
            signal.signal(signum, handler)


STOP_GRACE_S = 10.0  # after SIGTERM or Ctrl-C, how long a rank may take to stop by itself


def stop_grace() -> float:
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
    if value > MOST_SECONDS:  # 1e308 overflows the sleep of the watch thread
        raise UserError(f"{var}={text}: expected at most {MOST_SECONDS:g} seconds (a day)")
    return value


MOST_SECONDS = 86400.0


def stop_when_stuck(grace: float) -> None:
    """After SIGTERM or Ctrl-C, end the job if this rank has not stopped ``grace`` s later:
    Python runs handlers between bytecodes only, so a rank blocked in an MPI call would ignore
    the signal; a thread woken by ``set_wakeup_fd`` ends it. Call from the main thread."""
    from xpnn.runtime.interrupts import pending_signal

    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    if pending_signal() is not None:  # noted during the imports: MPI_Init may never return
        os.write(write_end, bytes([pending_signal()]))

    def watch() -> None:
        while True:
            signum = os.read(read_end, 1)[0]
            if signum in (*STOP_SIGNALS, signal.SIGINT):
                break
        what = Terminated(signum).words if signum != signal.SIGINT else "interrupted"
        code = 128 + signum
        left_in_init(what, code, grace)
        time.sleep(grace)
        rank, size = _mpi_rank_size()
        say(
            f"{prefix(rank, size)}{what}, and still not stopped after {grace:g} s (blocked in a "
            "call that does not return, such as MPI waiting for a rank that does not answer): "
            "ending the job"
        )
        if size > 1:
            from mpi4py import MPI

            MPI.COMM_WORLD.Abort(code)
        os._exit(code)

    threading.Thread(target=watch, name="xpnn-stop-watch", daemon=True).start()


INIT_GRACE_S = 2.0  # after a signal, how long a rank may still wait in MPI_Init for others


def left_in_init(what: str, code: int, grace: float) -> None:
    """End this rank (exit ``code``) once it has been inside ``MPI_Init`` for
    ``INIT_GRACE_S`` after a signal: the ranks it waits for may never come (one failed before
    MPI). Returns once MPI runs, or after ``grace`` s before it."""
    deadline = time.monotonic() + grace
    inside_since = None
    while time.monotonic() < deadline:
        now = time.monotonic()
        if in_mpi_init():
            inside_since = inside_since or now
            if now - inside_since >= INIT_GRACE_S:
                say(
                    f"rank {launch_rank()}: {what} while waiting in MPI_Init for the job's "
                    "other ranks, which have not all started: ending this rank"
                )
                os._exit(code)
        elif _mpi_started():
            return
        time.sleep(0.02)


def _mpi_started() -> bool:
    mpi = imported_mpi()
    return mpi is not None and mpi.Is_initialized()


def _mpi_rank_size() -> tuple[int, int]:
    """Never starts MPI."""
    mpi = imported_mpi()
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return 0, 1
    return mpi.COMM_WORLD.Get_rank(), mpi.COMM_WORLD.Get_size()


def silence_stdout() -> None:
    """Point stdout at /dev/null so the flush at exit does not fail again (Python's advice)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real stdout to redirect
        pass


def stopped_from_outside(exc: BaseException) -> tuple[str, int] | None:
    """(what to say, exit code) when ``exc`` means the run was stopped from outside rather
    than failed (``| head``, SIGTERM, Ctrl-C), else None; shared by the CLI and benchmarks."""
    if isinstance(exc, BrokenPipeError):
        silence_stdout()
        return "stdout was closed (broken pipe): stopped", SIGPIPE_EXIT
    if isinstance(exc, Terminated):
        return exc.words, 128 + exc.signum
    if isinstance(exc, KeyboardInterrupt):  # Ctrl-C, or mpiexec passing it on
        return "interrupted", 130
    return None


def run_guarded(world_or_comm: Any, fn: Callable[[], Any]) -> int:
    """Run ``fn()`` and turn its outcome into an exit code. A failure prints one line (2 for a
    UserError, 1 for a bug) and, with more than one rank, MPI_Aborts with that code."""
    rank, size = _rank_size(world_or_comm)
    try:
        from xpnn.runtime.interrupts import hand_over

        hand_over(Terminated)  # a signal noted while MPI started is raised here
        result = fn()
    except CollectiveExit as exc:
        _ignore_sigterm()
        return _exit_code(exc)
    except SystemExit as exc:
        code = _exit_code(exc)
        if code != 0 and size > 1:
            abort_job(code)
        return code
    except UserError as exc:
        if _debug() and exc.__cause__ is not None:  # a user's layer failed: where, in it
            traceback.print_exc()
        say(prefix(rank, size) + one_line(user_message(exc)))
        code = int(getattr(exc, "exit_code", 2))
        if size > 1:
            abort_job(code)
        return code
    except BaseException as exc:  # noqa: B036 -- KeyboardInterrupt too: others must stop
        if _debug():
            traceback.print_exc()
        message, code = stopped_from_outside(exc) or (describe(exc), 1)
        if isinstance(exc, KeyboardInterrupt | Terminated):  # first: Slurm's time limit sends
            _calm_further_signals()  # SIGTERM twice (slurmstepd's, then srun's own)
        flight.dump(f"failed: {message}")  # the operations it saw last, for the others' story
        if size > 1 and isinstance(exc, KeyboardInterrupt | Terminated) and stopped_together():
            if rank == 0:  # every rank was told (mpiexec passes signals on): one line for all
                say(f"xpnn: {message}")
            sys.stdout.flush()
            # the others leave once rank 0 has said it: the launcher may end a rank that is
            # still running when another leaves, and with it a line not yet written
            stopped_together()
            os._exit(code)  # no MPI_Abort: nothing more to stop, and no launcher banner
        say(prefix(rank, size) + message)
        if size > 1:
            abort_job(code)
        return code
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


def _ignore_sigterm() -> None:
    """Every rank leaves with one code, its files written: a launcher that ends the ranks still
    in ``MPI_Finalize`` when the first has left (``srun --kill-on-bad-exit`` on exit 75) must
    not turn that code into 143. Python's own exit puts SIGTERM's default back (and mpi4py
    finalizes after it), but not an ignored signal; a hung rank still gets the SIGKILL."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except ValueError:  # not the main thread: signals are not this code's to handle
        pass


def _calm_further_signals() -> None:
    """A second Ctrl-C must not cut the stopping short with a traceback: SIGINT and SIGTERM
    now only wake the watch of ``stop_when_stuck``."""
    try:
        for signum in (signal.SIGINT, *STOP_SIGNALS):
            if signal.getsignal(signum) != signal.SIG_IGN:
                signal.signal(signum, lambda *_: None)
    except ValueError:  # not the main thread: signals are not this code's to handle
        pass


STOP_TOGETHER_S = 1.0  # how long an interrupted rank waits to hear that all others were too


def stopped_together(within: float = STOP_TOGETHER_S) -> bool:
    """Whether every rank gets here within ``within`` s: then each may just exit, else the job
    needs MPI_Abort. On the stall watch's communicator, which no interrupted collective uses."""
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
    return _seconds("XPNN_AGREE_TIMEOUT", 60.0)


def _gather_codes(size: int, code: int) -> Any:
    """Every rank's exit code (0: fine), or None when a failed rank gave up waiting for the
    others after ``agree_timeout()`` (ranks that succeeded wait: others may still load data)."""
    from array import array  # not NumPy: a rank whose NumPy does not import gets here

    from mpi4py import MPI

    comm: Any = control_comm()
    codes = array("i", [0] * size)
    req = comm.Iallgather([array("i", [code]), MPI.INT32_T], [codes, MPI.INT32_T])
    if code == 0:
        stall.wait(req, "the agreement that setup succeeded")
        return codes
    deadline = time.monotonic() + agree_timeout()
    while not req.Test():
        if time.monotonic() > deadline:
            return None
        time.sleep(0.005)
    return codes


_SEVERITY = ("bug", "user", "exit")  # which failure the line of a failed setup names


def agree_on_user_errors(world_or_comm: Any, fn: Callable[[], T]) -> T:
    """Run the rank-local setup ``fn`` on every rank, then agree on whether to go on: on any
    failure rank 0 prints one line and every rank raises ``CollectiveExit`` with one code (bug
    1, else UserError 2, else SystemExit's). Keep ``fn`` free of collectives: a failed rank
    waits ``XPNN_AGREE_TIMEOUT`` s for the others, then aborts the job. Alone there is
    nothing to agree on: the error reaches the caller (a program, or ``run_guarded``)."""
    rank, size = _rank_size(world_or_comm)
    if size == 1:
        return fn()
    outcome: tuple[str, int, str] | None = None
    result: Any = None
    if size > 1:  # slow ranks are waited for here politely, not in MPI's spinning calls
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
        outcomes = control_comm().allgather(outcome)  # type: ignore[attr-defined]
    else:
        outcomes = [outcome]
    failed = [(r, o) for r, o in enumerate(outcomes) if o is not None]
    if not failed:
        return result

    first = min(failed, key=lambda item: _SEVERITY.index(item[1][0]))  # lowest rank on ties
    first_rank, (kind, code, message) = first
    if rank == 0 and message:
        everyone_same = len(failed) == size and all(o == first[1] for _, o in failed)
        if everyone_same or size == 1:
            line = f"xpnn: {message}"
        else:
            others = len(failed) - 1
            more = f" (and {others} more rank{'s' if others != 1 else ''})" if others else ""
            line = f"xpnn: rank {first_rank}: {message}{more}"
        say(line)
    raise CollectiveExit(code)
