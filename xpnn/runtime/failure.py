"""Failing well on many ranks: one line, the right exit code, MPI_Abort so that no rank hangs;
a start-up failing on some ranks ends the job at once (over MPI, else through the launcher)."""

import contextlib
import math
import os
import signal
import socket
import sys
import threading
import time
import traceback
from array import array  # not NumPy: a rank whose NumPy does not import gets to the agreement
from collections.abc import Callable
from typing import Any, TypeVar

from xpnn.errors import UserError, user_message
from xpnn.runtime import flight, interrupts, stall
from xpnn.runtime.interrupts import CODES, Terminated, abort_job, handle, prefix, say
from xpnn.runtime.world import STARTING, control_comm, init_world, launch_rank, launched_by_mpi

T = TypeVar("T")
STOP_GRACE_S = 10.0  # after SIGTERM or Ctrl-C, how long a rank may take to stop by itself
MOST_SECONDS = 86400.0  # 1e308 would overflow the watch thread's sleep
_SEVERITY = ("bug", "user", "exit")  # the failure a failed setup's line names first


class CollectiveExit(SystemExit):
    """Every rank leaves with this code together; no abort is needed."""


def _rank_size(world_or_comm: Any) -> tuple[int, int]:
    return (0, 1) if world_or_comm is None else (int(world_or_comm.rank), int(world_or_comm.size))


def one_line(text: str) -> str:
    return " | ".join(part.strip() for part in str(text).splitlines() if part.strip())


def describe(exc: BaseException) -> str:
    msg = one_line(str(exc))
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def said_once(first_rank: int, message: str, failed: int, size: int, same: bool) -> str:
    """One line for ``failed`` ranks: the message alone if all failed alike, else the first's."""
    if same and failed == size:
        return f"xpnn: {message}"
    more = f" (and {failed - 1} more rank{'s' if failed != 2 else ''})" if failed > 1 else ""
    return f"xpnn: rank {first_rank}: {message}{more}"


def _trace_if_debug(wanted: bool = True) -> None:
    if wanted and os.environ.get("XPNN_DEBUG", "") not in ("", "0"):
        traceback.print_exc()


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    say(one_line(str(exc.code)))
    return 1


def terminate_on_sigterm() -> None:
    """Raise ``Terminated`` on stop signals (the command line's choice: a library keeps its own)."""
    handle([signum for signum in CODES if signum != signal.SIGINT], interrupts.raise_terminated)


def stop_grace() -> float:
    return _seconds("XPNN_STOP_GRACE", STOP_GRACE_S)


def _seconds(var: str, default: float) -> float:
    text = os.environ.get(var, "").strip()
    try:
        value = float(text) if text else default
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):  # -5 or inf: the watch thread's sleep failed
        raise UserError(f"{var}={text}: expected a number of seconds >= 0")
    if value > MOST_SECONDS:
        raise UserError(f"{var}={text}: expected at most {MOST_SECONDS:g} seconds (a day)")
    return value


def stop_when_stuck(grace: float) -> None:
    """End the job ``grace`` s after SIGTERM or Ctrl-C: a rank blocked in MPI runs no handler."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    if (pending := interrupts.STATE["pending"]) is not None:  # noted during the imports
        os.write(write_end, bytes([pending]))  # MPI_Init may never return

    def watch() -> None:
        signum = 0
        while signum not in CODES:
            signum = os.read(read_end, 1)[0]
        what, code = CODES[signum]
        left_in_init(what, code, grace)
        time.sleep(grace)
        rank, size = interrupts.mpi_rank_size()
        say(
            f"{prefix(rank, size)}{what}, and still not stopped after {grace:g} s (blocked in a "
            "call that does not return, such as MPI waiting for a rank that does not answer): "
            "ending the job"
        )
        if size > 1:
            interrupts.imported_mpi().COMM_WORLD.Abort(code)
        os._exit(code)

    threading.Thread(target=watch, name="xpnn-stop-watch", daemon=True).start()


def left_in_init(what: str, code: int, grace: float) -> None:
    """End this rank 2 s into ``MPI_Init`` past a signal: the others may never come."""
    deadline, inside_since = time.monotonic() + grace, None
    while (now := time.monotonic()) < deadline:
        if STARTING["in_init"]:
            inside_since = inside_since or now
            if now - inside_since >= 2.0:
                say(
                    f"rank {launch_rank()}: {what} while waiting in MPI_Init for the job's "
                    "other ranks, which have not all started: ending this rank"
                )
                os._exit(code)
        elif _mpi_started():
            return
        time.sleep(0.02)


def _mpi_started() -> bool:
    mpi = interrupts.imported_mpi()
    return mpi is not None and mpi.Is_initialized()


def silence_stdout() -> None:
    """Point stdout at /dev/null so the flush at exit does not fail again (Python's advice)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):  # no real stdout
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def stopped_from_outside(exc: BaseException) -> tuple[str, int] | None:
    """(what to say, exit code) for a run stopped from outside (``| head``, a signal)."""
    if isinstance(exc, BrokenPipeError):
        silence_stdout()
        return "stdout was closed (broken pipe): stopped", 128 + signal.SIGPIPE
    if isinstance(exc, Terminated):
        return CODES[exc.args[0]]
    if isinstance(exc, KeyboardInterrupt):  # Ctrl-C, or mpiexec passing it on
        return CODES[signal.SIGINT]
    return None


def _fail(rank: int, size: int, message: str, code: int) -> int:
    say(prefix(rank, size) + message)
    if size > 1:
        abort_job(code)
    return code


def run_guarded(world_or_comm: Any, fn: Callable[[], Any]) -> int:
    """``fn()``'s outcome as an exit code; a failure said in one line and MPI_Aborted."""
    rank, size = _rank_size(world_or_comm)
    try:
        interrupts.hand_over()  # a signal noted while MPI started is raised here
        result = fn()
    except CollectiveExit as exc:
        # a launcher's SIGTERM to ranks still in MPI_Finalize (srun --kill-on-bad-exit) must
        # not make it 143; Python's exit keeps only an SIG_IGN
        handle([signal.SIGTERM], int(signal.SIG_IGN))
        return _exit_code(exc)
    except SystemExit as exc:
        code = _exit_code(exc)
        if code != 0 and size > 1:
            abort_job(code)
        return code
    except UserError as exc:
        _trace_if_debug(exc.__cause__ is not None)  # a user's layer failed: where, in it
        return _fail(rank, size, one_line(user_message(exc)), int(getattr(exc, "exit_code", 2)))
    except BaseException as exc:  # noqa: B036 -- KeyboardInterrupt too: others must stop
        _trace_if_debug()
        message, code = stopped_from_outside(exc) or (describe(exc), 1)
        stopped = isinstance(exc, KeyboardInterrupt | Terminated)
        if stopped:  # a second signal (Slurm's time limit sends two) only wakes stop_when_stuck
            handle(CODES, lambda *_: None)
        flight.dump(f"failed: {message}")
        if size > 1 and stopped and stall.stopped_together():
            if rank == 0:  # every rank was told (mpiexec passes signals on): one line for all
                say(f"xpnn: {message}")
            sys.stdout.flush()
            stall.stopped_together()  # leave once rank 0 said it: the launcher may end it on exit
            os._exit(code)  # no MPI_Abort: nothing more to stop, and no launcher banner
        return _fail(rank, size, message, code)
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


def agree_timeout() -> float:
    return _seconds("XPNN_AGREE_TIMEOUT", 60.0)


def agree_on_user_errors(world_or_comm: Any, fn: Callable[[], T]) -> T:
    """Run the rank-local setup ``fn``; a failure anywhere: every rank raises ``CollectiveExit``."""
    rank, size = _rank_size(world_or_comm)
    if size == 1:
        return fn()
    outcome: tuple[str, int, str] | None = None
    result: Any = None
    stall.wait(control_comm().Ibarrier(), "the barrier before a setup phase")
    try:
        result = fn()
    except UserError as exc:
        outcome = ("user", int(getattr(exc, "exit_code", 2)), one_line(user_message(exc)))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if code:
            outcome = ("exit", code, "")
    except Exception as exc:
        _trace_if_debug()
        outcome = ("bug", 1, describe(exc))
    from mpi4py import MPI

    code, codes = outcome[1] if outcome else 0, array("i", [0] * size)
    req = control_comm().Iallgather([array("i", [code]), MPI.INT32_T], [codes, MPI.INT32_T])
    if code == 0:
        stall.wait(req, "the agreement that setup succeeded")
    elif not stall.done_within(req, agree_timeout(), 0.005):  # some rank is stuck inside fn
        kind, code, message = outcome  # type: ignore[misc]
        if message:
            say(f"rank {rank}: {message}")
        abort_job(code)
    if not any(codes):
        return result
    failed = [(r, o) for r, o in enumerate(control_comm().allgather(outcome)) if o is not None]
    first_rank, first = min(failed, key=lambda item: _SEVERITY.index(item[1][0]))
    kind, code, message = first
    if rank == 0 and message:
        say(said_once(first_rank, message, len(failed), size, all(o == first for _, o in failed)))
    raise CollectiveExit(code)


START_UP_EXIT = 2  # a start-up problem is the user's to fix


def agree_to_start(world: Any, command: str, problem: str | None = None) -> None:
    """End every rank with exit 2 if a rank had a start-up ``problem`` or runs another command."""
    if world.size == 1:
        return
    everyone = stall.allgather(world.mpi_comm, (command, problem), "the start-up agreement")
    failed = [(rank, said) for rank, (_, said) in enumerate(everyone) if said]
    commands = [c for c, _ in everyone]
    if failed:
        (first_rank, first), same = failed[0], all(said == failed[0][1] for _, said in failed)
        line = said_once(first_rank, first, len(failed), world.size, same)
    elif len(set(commands)) > 1:
        other = next(r for r, c in enumerate(commands) if c != commands[0])
        line = (
            f"xpnn: rank {other} runs {commands[other]!r}, rank 0 {commands[0]!r}: every "
            "rank of a job must run the same command"
        )
    else:
        return
    if world.rank == 0:
        say(line)
    raise CollectiveExit(START_UP_EXIT)


def failed_import(exc: BaseException, command: str) -> int:
    """xpnn's own import failed (a broken install, a planted ``numpy.py``): every rank hears."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return _agree(command, one_line(f"cannot start: {type(exc).__name__}: {exc}{where}"), 1)


def help_given(command: str) -> int:
    """``-h`` printed help: under a launcher, agree with the others (an MPMD line) first."""
    return _agree(f"{command} --help", None, 0)


def _agree(command: str, line: str | None, code: int) -> int:
    """``agree_to_start`` under a launcher; ``line``, a start-up problem, said alone otherwise."""
    try:
        world = init_world() if launched_by_mpi() is not None else None
    except Exception as failed:  # noqa: BLE001 - no MPI to reach the others: end the job
        if line:
            say(f"rank {launch_rank()}: {line}; {one_line(str(failed))}")
        abort_launch(code)
        return code
    if world is None or world.size == 1:
        if line:
            say(f"xpnn: {line}")
        return code
    return run_guarded(world, lambda: agree_to_start(world, command, line))


def abort_launch(code: int = START_UP_EXIT) -> bool:
    """Ask hydra over PMI-1 to end a job whose rank cannot start MPI; whether it was sent."""
    fd = os.environ.get("PMI_FD", "")
    if not fd.isdigit():
        return False
    try:
        with socket.socket(fileno=int(fd)) as pmi:
            pmi.settimeout(5)
            pmi.sendall(b"cmd=init pmi_version=1 pmi_subversion=1\n")
            pmi.recv(1024)  # the launcher's answer: it now takes commands
            pmi.sendall(f"cmd=abort exitcode={code}\n".encode())
    except OSError:
        return False
    return True
