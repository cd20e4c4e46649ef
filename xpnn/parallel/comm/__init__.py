"""Communicators, one interface for every transport, and the choice of one."""

from typing import Any

from xpnn.errors import UserError
from xpnn.parallel.comm.base import Communicator, SelfCommunicator
from xpnn.parallel.comm.cuda import make_gpu_communicator
from xpnn.parallel.comm.mpi import MpiHostCommunicator, arrays_of
from xpnn.parallel.comm.shm import ShmCommunicator, forced_ranks_per_node
from xpnn.runtime.world import World

KINDS = ("auto", "mpi-shm", "mpi-host", "mpi-cuda", "nccl", "self")


def make_communicator(
    world: World, backend: Any, kind: str = "auto", shares_params: bool = True
) -> Communicator:
    """The communicator for ``--comm kind`` (collective); ``shares_params``: node memory may."""
    if kind not in KINDS:
        raise UserError(f"`comm` {kind}: choose one of {', '.join(KINDS)}")
    is_gpu = bool(getattr(backend, "is_gpu", False))
    library = getattr(backend, "array_library", "numpy")  # a Backend's; stand-ins lack it
    if not is_gpu and kind in ("mpi-cuda", "nccl"):
        raise UserError(f"`comm` {kind}: needs `backend` cupy (or torch on a GPU)")
    if is_gpu and kind == "mpi-shm":
        raise UserError("`comm` mpi-shm: needs a CPU backend (numpy or numba)")
    if kind == "mpi-shm" and library != "numpy":
        why = f"node-shared memory holds NumPy arrays, not {library}'s"
        raise UserError(f"`comm` mpi-shm: {why} (backend numpy or numba; torch uses mpi-host)")
    if kind == "mpi-shm" and not shares_params:
        raise UserError(
            "`comm` mpi-shm: shares one copy of the parameters between data-parallel ranks; "
            "these ranks split the network: use mpi-host or auto"
        )
    if kind == "self" and world.size > 1:
        raise UserError(f"`comm` self: only for a single process, this job has {world.size}")
    if kind == "self" or world.mpi_comm is None or (world.size == 1 and kind == "auto"):
        return SelfCommunicator()
    if is_gpu:
        return make_gpu_communicator(world, kind, arrays_of(library))
    if not shares_params or kind == "mpi-host":
        return MpiHostCommunicator(world.mpi_comm, arrays_of(library))
    reason = f"node-shared memory holds NumPy arrays, not {library}'s"  # ``auto`` only
    if library == "numpy":
        forced_ranks_per_node()  # a typo there is the user's to fix, not a reason to fall back
        try:
            return ShmCommunicator.create(world.mpi_comm)
        except UserError as exc:
            if kind == "mpi-shm":
                raise
            reason = str(exc).removeprefix("`comm` mpi-shm: ")
    comm = MpiHostCommunicator(world.mpi_comm, arrays_of(library))
    comm.auto_fallback = f"not mpi-shm: {reason}"
    return comm


__all__ = ["KINDS", "Communicator", "MpiHostCommunicator", "SelfCommunicator"]
__all__ += ["ShmCommunicator", "make_communicator"]
