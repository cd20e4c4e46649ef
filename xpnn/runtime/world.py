"""This process's rank, size and node-local rank. MPI starts only under a launcher (or with
``XPNN_FORCE_MPI=1``): it is slow to start and some clusters refuse it outside one."""

import contextlib
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from xpnn.errors import UserError
from xpnn.runtime import segments, stall
from xpnn.runtime.interrupts import launcher_rank
from xpnn.runtime.threads import affinity, core_share, cpu_quota, quota_cores

# set by MPICH/Hydra, Intel MPI, Open MPI, PMIx, MVAPICH, Cray PALS/ALPS launchers
_LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE")
_LAUNCHER_VARS += ("OMPI_COMM_WORLD_RANK", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_SIZE")
_LAUNCHER_VARS += ("PALS_RANKID", "ALPS_APP_PE")
_CONTROL: Any = None  # a duplicate of COMM_WORLD for failure agreement
STARTING = {"in_init": False}  # read by the stop watch thread while MPI_Init blocks
LIBMPI_NAMES = ("libmpi", "libimpi", "libmpich")  # MPICH, Open MPI, Intel MPI's file names


def control_comm() -> Any:
    """``failure``'s own communicator, which no collective of the run uses."""
    from mpi4py import MPI

    return MPI.COMM_WORLD if _CONTROL is None else _CONTROL


class LaunchMismatch(UserError):
    """A launcher and an MPI library that cannot work together (every rank finds it alike)."""


@dataclass
class World:
    """This process's place in the job; ``mpi_comm`` is None without MPI."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    mpi_comm: object | None
    speaks: bool | None = None  # a group of the job's ranks: is this the job's rank 0?
    cores: int | None = None  # this rank's share of the cores it may run on (core_share)
    crowded: bool = False  # more ranks than cores where this rank runs
    node_sizes: tuple[int, ...] = (1,)  # ranks on each node (MPI's shared-memory groups)

    @property
    def is_root(self) -> bool:
        """Rank 0 of the job prints, logs and saves (a group's rank 0 may not be it)."""
        return self.rank == 0 if self.speaks is None else self.speaks

    def allgather_obj(self, obj: Any, what: str) -> list:
        """One small object from every rank, in rank order, the wait polled and named ``what``."""
        return [obj] if self.mpi_comm is None else stall.allgather(self.mpi_comm, obj, what)

    def barrier(self, what: str) -> None:
        if self.mpi_comm is not None:
            stall.wait(self.mpi_comm.Ibarrier(), what)

    def split(self, color: int) -> "World":
        from mpi4py import MPI

        comm = self.mpi_comm.Split(color=color, key=self.rank)  # type: ignore[union-attr]
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        try:
            local_rank, local_size = local.Get_rank(), local.Get_size()
        finally:
            local.Free()
        return World(comm.Get_rank(), comm.Get_size(), local_rank, local_size, comm, self.is_root)


def describe_ranks(size: int, node_sizes: tuple[int, ...]) -> str:
    """``4 rank(s)``, ``2 node(s) x 2 rank(s)``, or ``3 rank(s) on 2 node(s) (2, 1)``."""
    if len(node_sizes) < 2:
        return f"{size} rank(s)"
    if len(set(node_sizes)) == 1:
        return f"{len(node_sizes)} node(s) x {node_sizes[0]} rank(s)"
    return f"{size} rank(s) on {len(node_sizes)} node(s) ({', '.join(map(str, node_sizes))})"


def launched_by_mpi(env: Mapping[str, str] | None = None) -> str | None:
    """The variable that shows an MPI launcher started us (a false positive costs a singleton)."""
    env = os.environ if env is None else env
    force = env.get("XPNN_FORCE_MPI", "").strip()
    if force not in ("", "0", "1"):
        raise UserError(f"XPNN_FORCE_MPI={force}: use 0 or 1")
    if force:
        return "XPNN_FORCE_MPI" if force == "1" else None
    found = next((var for var in _LAUNCHER_VARS if env.get(var)), None)
    if found or "SLURM_PROCID" not in env:
        return found
    ntasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or "1"
    with contextlib.suppress(ValueError):
        if int(ntasks.split("(")[0]) > 1:
            return "SLURM_PROCID"
    return None


def launch_rank() -> int:
    return launcher_rank() or 0


def library_name(library_version: str) -> str:
    """The first line of ``MPI_Get_library_version``, spaces squeezed, Open MPI's NUL gone."""
    return " ".join((library_version.replace("\x00", "").splitlines() or [""])[0].split())


def check_launcher_size(size: int, env: Mapping[str, str], library_version: str) -> None:
    """Refuse N launched processes that MPI sees fewer of: each would train alone."""
    library = library_name(library_version)
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"):
        try:
            launched = int(env.get(var, ""))
        except ValueError:
            continue
        if launched > size:
            raise UserError(
                f"the launcher started {launched} processes ({var}={launched}) but MPI sees "
                f"{size}: mpi4py loaded {library!r}, not the launcher's MPI; use the mpiexec "
                "of that library, or point mpi4py at the launcher's one with "
                "MPI4PY_LIBMPI=/path/to/libmpi.so"
            )
        return  # the MPI launcher's own count settles it
    # mpiexec inside an allocation starts its proxies with srun: one task a node, not a rank
    tasks = env.get("SLURM_STEP_NUM_TASKS", "")  # how many tasks srun started in this job step
    if "SLURM_STEP_ID" in env and tasks.isdigit() and int(tasks) > size:
        raise UserError(
            f"srun started {tasks} tasks (SLURM_STEP_NUM_TASKS={tasks}) but MPI sees {size}: "
            f"srun gave them no process-management interface that {library!r} speaks; use "
            "srun --mpi=pmi2 (MPICH, the mpich wheel) or --mpi=pmix (Open MPI), or mpiexec "
            "inside the allocation"
        )


def check_pmix(env: Mapping[str, str], library_version: str) -> None:
    """Refuse an MPICH without PMIx under a PMIx launcher, before its ``MPI_Init`` aborts."""
    var = next((v for v in ("PMIX_RANK", "PMIX_NAMESPACE") if env.get(v)), None)
    first = library_name(library_version)
    if var is None or not first.startswith("MPICH") or "pmix" in library_version.lower():
        return
    raise LaunchMismatch(
        f"started through PMIx ({var} is set: Open MPI's mpirun, or srun --mpi=pmix) but "
        f"mpi4py loaded {first!r}, built without PMIx; use that library's mpiexec or srun "
        "--mpi=pmi2, or point mpi4py at the launcher's MPI with "
        "MPI4PY_LIBMPI=/path/to/libmpi.so"
    )


def _start_mpi(hint: str, env: Mapping[str, str]) -> tuple[Any, str]:
    """Start MPI; the module and its library's version, asked before a fatal ``MPI_Init``."""
    os.environ.setdefault("UCX_DEBUG_SIGNO", "0")  # the mpich wheel's UCX: no pages on SIGHUP
    try:
        import mpi4py

        if "mpi4py.MPI" not in sys.modules:  # else too late to choose: MPI has started
            mpi4py.rc.initialize = False
            mpi4py.rc.finalize = True
        from mpi4py import MPI
    except Exception as exc:  # ImportError, or RuntimeError when libmpi cannot be loaded
        raise UserError(
            f"started by an MPI launcher ({hint} is set) but mpi4py failed to load: {exc}"
        ) from exc
    library = MPI.Get_library_version().replace("\x00", "")
    check_pmix(env, library)
    if not MPI.Is_initialized():
        _init_thread(MPI)
    return MPI, library


def loaded_libmpi(symbol: str = "MPI_Get_version") -> Any:
    """The loaded MPI library with ``symbol`` (mpi4py >= 4.1 loads it RTLD_LOCAL), loading none."""
    import ctypes

    names = {path: os.path.basename(path) for path in segments.mapped_files()}
    candidates = [p for p, name in names.items() if name.startswith(LIBMPI_NAMES) and ".so" in name]
    mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 1)
    for path in [*candidates, None]:
        try:
            lib = ctypes.CDLL(path, mode=mode) if path else ctypes.CDLL(None)
        except OSError:
            continue
        if hasattr(lib, symbol):
            return lib
    return None


def _init_thread(MPI: Any) -> None:
    """``MPI_Init_thread`` without Python's lock, so the stop watch can end a rank left waiting."""
    import ctypes

    if (lib := loaded_libmpi("MPI_Init_thread")) is None:
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
        return
    level, provided = ctypes.c_int(MPI.THREAD_MULTIPLE), ctypes.c_int()
    STARTING["in_init"] = True
    try:
        code = lib.MPI_Init_thread(None, None, level, ctypes.byref(provided))
    finally:
        STARTING["in_init"] = False
    if code != 0:
        raise UserError(f"MPI_Init_thread failed (MPI error {code})")


def init_world(env: Mapping[str, str] | None = None) -> World:
    """Rank, size and node-local rank/size, asked of MPI (the environment only starts it)."""
    if (hint := launched_by_mpi(env)) is None:
        return World(rank=0, size=1, local_rank=0, local_size=1, mpi_comm=None)
    env = os.environ if env is None else env
    MPI, library = _start_mpi(hint, env)
    global _CONTROL
    world = MPI.COMM_WORLD
    check_launcher_size(world.Get_size(), env, library)
    comm = world.Dup()
    if _CONTROL is None:
        _CONTROL = world.Dup()
        stall.STATE["comm"] = world.Dup()  # stall notes and the agreement to stop on a signal
    local = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    try:
        local_rank, local_size = local.Get_rank(), local.Get_size()
        own = affinity()
        quota = quota_cores(cpu_quota())  # a container's limit, if any
        cores, crowded = core_share(own, local.allgather(own), quota)  # bound ranks or not
        node_sizes = tuple(n for n in world.allgather(local_size if local_rank == 0 else 0) if n)
    finally:
        local.Free()
    segments.unlink_mpich_segments()  # the node's ranks have all passed MPI_Init
    segments.unlink_hydra_topology()
    if local_rank == 0:  # and what earlier jobs left (one rank a node)
        segments.remove_stale()
    rank, size = comm.Get_rank(), comm.Get_size()
    return World(rank, size, local_rank, local_size, comm, None, cores, crowded, node_sizes)
