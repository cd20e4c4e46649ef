"""Whether MPI is there to ask, from any thread, without starting or importing it."""

import sys
from typing import Any


def imported_mpi() -> Any:
    """``mpi4py.MPI`` once another thread has finished importing it (never importing it): a module
    being imported is in ``sys.modules`` without its functions yet."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or getattr(getattr(mpi, "__spec__", None), "_initializing", False):
        return None
    return mpi if hasattr(mpi, "Is_finalized") else None
