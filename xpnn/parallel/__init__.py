"""Parallel runtime: who am I (``world``), how ranks talk (``comm``), failing well
(``failure``) and CPU threads per rank (``threads``).

Importing this package imports neither mpi4py nor CuPy: MPI starts in ``init_world`` only
under a launcher, CuPy only when a GPU communicator is built.
"""

from xpnn.parallel.comm import (
    Communicator,
    Handle,
    MpiHostCommunicator,
    SelfCommunicator,
    make_communicator,
)
from xpnn.parallel.cuda_aware import CudaAwareness, detect_cuda_aware
from xpnn.parallel.failure import CollectiveExit, agree_on_user_errors, run_guarded
from xpnn.parallel.threads import apply_threads, threads_per_rank
from xpnn.parallel.world import World, init_world

__all__ = [
    "CollectiveExit",
    "Communicator",
    "CudaAwareness",
    "Handle",
    "MpiHostCommunicator",
    "SelfCommunicator",
    "World",
    "agree_on_user_errors",
    "apply_threads",
    "detect_cuda_aware",
    "init_world",
    "make_communicator",
    "run_guarded",
    "threads_per_rank",
]
