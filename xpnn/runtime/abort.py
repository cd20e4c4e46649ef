"""A rank's last words and the end of the job (apart from ``failure``, which uses ``stall``)."""

import sys
import time

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
