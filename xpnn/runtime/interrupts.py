"""How a rank ends: Ctrl-C and SIGTERM before ``run_guarded`` (one line and exit 130, 143; a rank
under a launcher notes it until MPI runs), its last line, and MPI_Abort. Imports only what Python
loads first (not ``signal``, nor ``mpi4py``: whether MPI runs is asked from any thread)."""

import _signal
import contextlib
import os
import sys
import time
import types
from collections.abc import Callable, Iterable

_LAUNCHER_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")
# end a run as Ctrl-C does, exit 128 + number: Slurm's time limit and scancel (TERM), a closed
# terminal or ssh connection (HUP), Ctrl-\\ (QUIT), a CPU-time limit (XCPU)
CODES = {_signal.SIGINT: ("interrupted", 130)}  # signal -> (what to say, exit code)
for _name in ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGXCPU"):
    if hasattr(_signal, _name):
        CODES[getattr(_signal, _name)] = (f"terminated ({_name})", 128 + getattr(_signal, _name))
# pending: a stop signal noted under a launcher, for ``hand_over`` (and the stop watch) to act on;
# requested: the checkpoint signals that arrived while ``catch_early_checkpoint_signal`` held them
STATE: dict = {"installed": False, "pending": None, "requested": set()}
SAID: list[str] = []  # the last line ``say`` wrote: a failed run's reason, for ``RunFailed``


class Terminated(BaseException):
    """A stop signal arrived (its number the one argument): stop as on Ctrl-C."""


def raise_terminated(signum: int, _frame: object) -> None:
    raise Terminated(signum)


def handle(signums: Iterable[int], handler: Callable | int) -> None:
    """``handler`` for each signal not ignored (nohup's SIGHUP stays so), on the main thread."""
    with contextlib.suppress(ValueError):
        for signum in signums:
            if _signal.getsignal(signum) != _signal.SIG_IGN:
                _signal.signal(signum, handler)


def launcher_rank() -> int | None:
    ranks = (int(os.environ[v]) for v in _LAUNCHER_RANK_VARS if os.environ.get(v, "").isdigit())
    return next(ranks, None)


def _handler(signum: int, _frame: object) -> None:
    if launcher_rank() is None:
        what, code = CODES[signum]
        os.write(2, f"xpnn: {what}\n".encode())
        os._exit(code)
    if STATE["pending"] is None:
        STATE["pending"] = signum


def catch_early_interrupts() -> None:
    """Handle SIGINT and SIGTERM until ``hand_over``; one the parent left ignored stays so."""
    handle(CODES, _handler)
    STATE["installed"] = True
    if mark := os.environ.get("XPNN_HANDLER_MARK"):  # for the tests: the handler is in place now
        with open(f"{mark}.{launcher_rank() or 0}", "w") as fh:
            fh.write(str(os.getpid()))  # whom to signal


def catch_early_checkpoint_signal(argv: list[str]) -> None:
    """Note ``--checkpoint-signal`` USR1 or USR2 (``SIGNALS``) early: else they end the rank."""
    name = None
    for i, word in enumerate(argv):
        if word == "--checkpoint-signal" and i + 1 < len(argv):
            name = argv[i + 1]
        elif word.startswith("--checkpoint-signal="):
            name = word.partition("=")[2]
    if name in ("USR1", "USR2") and hasattr(_signal, f"SIG{name}"):
        handle([getattr(_signal, f"SIG{name}")], lambda num, _: STATE["requested"].add(num))


def hand_over() -> None:
    """SIGINT raises ``KeyboardInterrupt`` again, SIGTERM ``Terminated``; a pending one now."""
    if not STATE["installed"]:
        return
    STATE["installed"] = False
    for signum in CODES:
        if _signal.getsignal(signum) is _handler:
            interrupt = signum == _signal.SIGINT
            _signal.signal(signum, _signal.default_int_handler if interrupt else raise_terminated)
    pending, STATE["pending"] = STATE["pending"], None
    if pending == _signal.SIGINT:
        raise KeyboardInterrupt
    if pending is not None:
        raise Terminated(pending)


def forget_handled_interrupt() -> None:
    """Clear the unhandled-Ctrl-C flag that C imports leave set: Python would end by SIGINT."""
    import ctypes

    ctypes.pythonapi.PyRun_SimpleString(b"pass")


def abort_job(code: int) -> None:
    """Flush, pause so hydra forwards the line (it drops what is still piped), MPI_Abort."""
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(0.3)
    from mpi4py import MPI

    MPI.COMM_WORLD.Abort(code)


def prefix(rank: int, size: int) -> str:
    return f"rank {rank}: " if size > 1 else "xpnn: "


def say(line: str) -> None:
    """One line on stderr in one write, so launchers never merge two ranks' lines into one."""
    SAID[:] = [line]
    if sys.stderr is not None:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def imported_mpi() -> types.ModuleType | None:
    """``mpi4py.MPI`` once fully imported, never importing it (half-imported it lacks functions)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or getattr(getattr(mpi, "__spec__", None), "_initializing", False):
        return None
    return mpi if hasattr(mpi, "Is_finalized") else None


def mpi_rank_size() -> tuple[int, int]:
    """This process's rank and the job's size while MPI runs, else (0, 1)."""
    mpi = imported_mpi()
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return 0, 1
    return mpi.COMM_WORLD.Get_rank(), mpi.COMM_WORLD.Get_size()
