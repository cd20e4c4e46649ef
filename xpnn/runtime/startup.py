"""A start-up failing on some ranks ends the job at once (over MPI, else through the launcher)."""

import os
import socket
import traceback
from typing import Any

from xpnn.runtime import stall
from xpnn.runtime.abort import say
from xpnn.runtime.failure import CollectiveExit, one_line, run_guarded, said_once
from xpnn.runtime.world import init_world, launch_rank, launched_by_mpi

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
