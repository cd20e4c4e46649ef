"""A rank's last line and the job's end; whether MPI runs, asked from any thread, importing none."""

import sys
import time
from typing import Any

SAID: list[str] = []  # the last line ``say`` wrote: a failed run's reason, for ``RunFailed``


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


def imported_mpi() -> Any:
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
