"""A job whose ranks fail at start-up on only some of them ends at once, never waits: a rank
that found a problem before MPI runs (a bad flag in one segment of an MPMD line, a bad
variable in its environment) still starts MPI, and the first exchange of every command,
``agree_to_start``, tells every rank; rank 0 says the line once and all leave with exit 2.
A rank that cannot start MPI at all asks the launcher to end the job (``abort_launch``)."""

from __future__ import annotations

import os
import socket
from typing import Any

from xpnn.runtime import stall
from xpnn.runtime.abort import say
from xpnn.runtime.failure import CollectiveExit

START_UP_EXIT = 2  # a start-up problem is the user's to fix


def agree_to_start(world: Any, command: str, problem: str | None = None) -> None:
    """Every rank's command and start-up ``problem`` (a line, or None), gathered once MPI is
    up: any problem, or ranks running different commands (``info : train``), ends every rank
    with ``CollectiveExit(2)`` after rank 0 says it. Alone, a problem is the caller's to say."""
    if world.size == 1:
        return
    everyone = stall.allgather(world.mpi_comm, (command, problem), "the start-up agreement")
    failed = [(rank, said) for rank, (_, said) in enumerate(everyone) if said]
    commands = [c for c, _ in everyone]
    if failed:
        line = _once(failed, world.size)
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


def _once(failed: list[tuple[int, str]], size: int) -> str:
    """One line for every rank's problem: the same everywhere is said as one; else the first
    rank's, with how many more had one."""
    first_rank, first = failed[0]
    if len(failed) == size and all(said == first for _, said in failed):
        return f"xpnn: {first}"
    more = len(failed) - 1
    also = f" (and {more} more rank{'s' if more != 1 else ''})" if more else ""
    return f"xpnn: rank {first_rank}: {first}{also}"


def failed_import(exc: BaseException, command: str) -> int:
    """xpnn's own import failed on this rank (a broken install, a planted ``numpy.py`` on one
    segment's ``PYTHONPATH``): one line naming where, and, under a launcher, MPI started
    anyway (without NumPy) so that every rank hears of it in the start-up agreement."""
    import traceback

    from xpnn.runtime.failure import one_line, run_guarded
    from xpnn.runtime.world import init_world, launch_rank, launched_by_mpi

    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    line = one_line(f"cannot start: {type(exc).__name__}: {exc}{where}")
    try:
        under_launcher = launched_by_mpi() is not None
        world = init_world() if under_launcher else None
    except Exception as failed:  # noqa: BLE001 - MPI does not start here either: end the job
        say(f"rank {launch_rank()}: {line}; {one_line(str(failed))}")
        abort_launch(1)
        return 1
    if world is None or world.size == 1:
        say(f"xpnn: {line}")
        return 1
    return run_guarded(world, lambda: agree_to_start(world, command, line))


def help_given(command: str) -> int:
    """``-h`` printed this rank's help (argparse, exit 0): under a launcher whose other ranks
    run (an MPMD line with ``-h`` in one segment), they must not wait in ``MPI_Init``: every
    rank states its command as ``help``, and a job not all asking for help ends (exit 2)."""
    from xpnn.runtime.failure import run_guarded
    from xpnn.runtime.world import init_world, launched_by_mpi

    try:
        if launched_by_mpi() is None:
            return 0
        world = init_world()
    except Exception:  # noqa: BLE001 - no MPI to reach the others: help was all there was
        abort_launch(0)
        return 0
    if world.size == 1:
        return 0
    return run_guarded(world, lambda: agree_to_start(world, f"{command} --help"))


def abort_launch(code: int = START_UP_EXIT) -> bool:
    """Ask the launcher to end the whole job, for a rank that cannot start MPI (its library
    does not load): the others would wait in ``MPI_Init`` for ever. Speaks the PMI-1 wire
    protocol on ``PMI_FD``, which MPICH's hydra answers; whether it was sent. Where there is
    none (Open MPI, PMIx), the launcher notices this process's exit in its own time."""
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
