"""The last words of a rank: one line on stderr, and the end of every rank of the job. Apart
from ``failure`` so that the stall watch, which ``failure`` uses, can end a job too."""

from __future__ import annotations

import sys
import time

ABORT_GRACE_S = 0.3


def abort_job(code: int) -> None:
    """End every rank of the job: flush what this rank printed, then MPI_Abort.

    The short pause lets the launcher forward the message before it tears the job down
    (hydra can drop output still in its pipes when the abort arrives first).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(ABORT_GRACE_S)
    from mpi4py import MPI

    MPI.COMM_WORLD.Abort(code)


def say(line: str) -> None:
    """One line on stderr in one write: Python's stderr writes through, so ``print`` would send
    the text and its newline apart, and two ranks' lines could run together (``rank 1:
    interruptedrank 0: interrupted``) where the launcher merges their output."""
    if sys.stderr is not None:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
