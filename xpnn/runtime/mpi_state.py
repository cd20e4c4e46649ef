"""Whether MPI is there to ask, from any thread, without starting or importing it."""

import sys
from typing import Any


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
