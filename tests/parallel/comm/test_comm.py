"""Communicators, world detection and failure handling under a real ``mpiexec``.

Each multi-rank test writes a small script to ``tmp_path`` and runs it with
``mpiexec -n N``; the script checks its own results and exits non-zero on a mismatch (through
``run_guarded``, so a failed check aborts every rank instead of hanging). Every launch has a
timeout, so a hang fails the test instead of the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import ROOT, mpiexec_path

from xpnn.errors import UserError
from xpnn.parallel.comm import SelfCommunicator, make_communicator
from xpnn.parallel.comm.cuda import choose_gpu_kind, shared_gpu
from xpnn.runtime.failure import agree_on_user_errors, run_guarded
from xpnn.runtime.world import World, check_launcher_size, check_pmix, launched_by_mpi

CPU = SimpleNamespace(name="numpy", is_gpu=False, xp=np)
GPU = SimpleNamespace(name="cupy", is_gpu=True, xp=None)
LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "MPI_LOCAL", "HYDRA_", "SLURM_", "MV2_", "PALS_")


def _clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without any launcher variables (pytest may itself run in one)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES)}
    env.pop("XPNN_FORCE_MPI", None)
    env.pop("XPNN_CUDA_AWARE", None)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def run_script(
    tmp_path: Path, body: str, ranks: int | None, timeout: float = 30, **env: str
) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``body`` as a script, under ``mpiexec -n ranks`` (or alone if ranks is None)."""
    script = tmp_path / f"script_{abs(hash(body)) % 10**8}_{ranks}.py"
    script.write_text(textwrap.dedent(body))
    cmd = [sys.executable, str(script)]
    if ranks is not None:
        cmd = [mpiexec_path(), "-n", str(ranks), *cmd]
    start = time.monotonic()
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=_clean_env(**env)
    )
    return proc, time.monotonic() - start


COLLECTIVES = """
import os, sys
import numpy as np
from types import SimpleNamespace
from xpnn.parallel.comm import make_communicator
from xpnn.runtime import init_world, run_guarded, threads_per_rank

EXPECTED_SIZE = int(sys.argv[1]) if len(sys.argv) > 1 else {ranks}

def main():
    w = init_world()
    n = w.size
    assert n == EXPECTED_SIZE, (n, EXPECTED_SIZE)
    if "PMI_SIZE" in os.environ:  # MPICH's hydra says what it launched
        assert (w.size, w.rank) == (int(os.environ["PMI_SIZE"]), int(os.environ["PMI_RANK"]))
    assert (w.local_rank, w.local_size) == (w.rank, w.size), (w.local_rank, w.local_size)
    comm = make_communicator(w, SimpleNamespace(name="numpy", is_gpu=False, xp=np))
    expected_name = "mpi-shm" if n > 1 else "self"
    assert comm.name == expected_name and comm.fallback_reason is None, comm.name
    if n > 1:  # every rank sees what every other rank wrote to a shared array
        shared = comm.shared_zeros((n, 3), np.float64)
        shared[w.rank] = w.rank + 1
        comm.fence()
        assert np.array_equal(shared[:, 2], np.arange(1, n + 1)), shared
        comm.fence()
        # every rank's gradient row starts on a page, whatever the model's size (777 values)
        from xpnn.backends import get_backend
        from xpnn.nn import build_model
        from xpnn.train.optim import Schedule, make_optimizer
        from xpnn.parallel.plan import Plan
        backend = get_backend("numpy", "float32")
        model = build_model("mlp", (16,), "relu", 9).build((38,), backend, 0)
        assert model.size % 1024 != 0, model.size
        def opt(p, g, parts, zeros):
            return make_optimizer("adam", p, g, backend.kernels, Schedule(0.1), parts, zeros)
        update = Plan(node_share="gradients").make_update(model, comm, opt, 1 << 20, 32)
        assert update.own.ctypes.data == model.grads.ctypes.data
        assert model.grads.ctypes.data % 4096 == 0
        assert all(row.ctypes.data % 4096 == 0 for row in update.others)
    r = w.rank
    for dtype in (np.float32, np.float64):
        for size in (1, 7, 1000, 1 << 16):
            base = np.arange(size, dtype=dtype) % 97
            buf = base + r
            comm.allreduce_(buf, "sum")
            want = n * base + n * (n - 1) / 2
            assert buf.dtype == dtype and np.array_equal(buf, want.astype(dtype)), ("sum", size)
            buf = base * (r + 1)
            comm.allreduce_(buf, "max")
            assert np.array_equal(buf, (base * n).astype(dtype)), ("max", dtype, size)
            buf = base - r
            comm.allreduce_(buf, "min")
            assert np.array_equal(buf, (base - (n - 1)).astype(dtype)), ("min", dtype, size)
            buf = np.full(size, -1, dtype) if r else base.copy()
            comm.bcast_(buf, root=0)
            assert np.array_equal(buf, base), ("bcast0", size)
            buf = base * 2 if r == n - 1 else np.zeros(size, dtype)
            comm.bcast_(buf, root=n - 1)
            assert np.array_equal(buf, base * 2), ("bcast last", size)
        # several non-blocking reductions in flight at once, equal sizes included
        bufs = [np.full(4096, r + k, dtype) for k in range(4)]
        handles = [comm.iallreduce_(b, "sum") for b in bufs]
        for k, (b, h) in enumerate(zip(bufs, handles)):
            h.wait()
            h.wait()  # idempotent
            assert np.all(b == n * k + n * (n - 1) / 2), ("iallreduce", k)
        b = np.full(10, float(r), dtype)
        comm.iallreduce_(b, "max").wait()
        assert np.all(b == n - 1)
        # reduce-scatter: each rank its piece's sum (an empty piece too), several in flight;
        # the all-gather then makes every rank's buffer whole
        uneven = [0 if k == n // 2 else k % 3 * 4 + 1 for k in range(n)] if n > 1 else [3]
        for counts in ([5] * n, uneven):
            lo = sum(counts[:r])
            hi = lo + counts[r]
            base = np.arange(sum(counts), dtype=dtype) % 97
            bufs = [base + r + k for k in range(3)]
            handles = [comm.ireduce_scatter_(b, counts) for b in bufs]
            for k, (b, h) in enumerate(zip(bufs, handles)):
                h.wait()
                h.wait()  # idempotent
                want = (n * (base + k) + n * (n - 1) / 2).astype(dtype)
                assert np.array_equal(b[lo:hi], want[lo:hi]), ("reduce-scatter", counts, k)
                b[:lo] = -1
                b[hi:] = -1
                comm.allgather_(b, counts)
                assert np.array_equal(b, want), ("all-gather", counts, k)
    # metrics: float64 sums of counts, exact beyond float32 and int32
    big = 2**50 + r  # n * 2**50 needs 52 bits: exact in float64, not in float32
    got = comm.allreduce_host(np.array([big, 1, 0.5]))
    assert got.dtype == np.float64
    assert got[0] == n * 2**50 + n * (n - 1) // 2 and got[1] == n and got[2] == 0.5 * n, got
    assert comm.allreduce_host([r], "max")[0] == n - 1
    assert comm.allreduce_host([r], "min")[0] == 0
    assert comm.allgather_obj(("rank", r)) == [("rank", k) for k in range(n)]
    comm.barrier()
    t = threads_per_rank(w.local_size)
    assert t == max(1, len(os.sched_getaffinity(0)) // w.local_size), t
    print(f"OK rank {{r}} of {{n}} threads {{t}}", flush=True)

sys.exit(run_guarded(init_world(), main))
"""


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_collectives_under_mpiexec(tmp_path: Path, ranks: int) -> None:
    proc, _ = run_script(tmp_path, COLLECTIVES.format(ranks=ranks), ranks, timeout=60)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    for r in range(ranks):
        assert f"OK rank {r} of {ranks}" in proc.stdout


def test_init_world_without_launcher_does_not_import_mpi(tmp_path: Path) -> None:
    body = """
    import sys
    from xpnn.parallel.comm import make_communicator
    from xpnn.runtime import init_world
    import numpy as np
    from types import SimpleNamespace
    w = init_world()
    assert (w.rank, w.size, w.local_rank, w.local_size, w.mpi_comm) == (0, 1, 0, 1, None), w
    c = make_communicator(w, SimpleNamespace(name="numpy", is_gpu=False, xp=np), "mpi-host")
    assert c.name == "self", c.name
    assert "mpi4py" not in sys.modules, "mpi4py was imported"
    assert "cupy" not in sys.modules
    print("NO-MPI OK")
    """
    proc, _ = run_script(tmp_path, body, None)
    assert proc.returncode == 0, proc.stderr
    assert "NO-MPI OK" in proc.stdout


@pytest.mark.mpi
def test_force_mpi_without_launcher(tmp_path: Path) -> None:
    body = """
    import sys
    from xpnn.runtime import init_world
    w = init_world()
    assert "mpi4py.MPI" in sys.modules and w.mpi_comm is not None and w.size == 1
    print("FORCED OK")
    """
    proc, _ = run_script(tmp_path, body, None, XPNN_FORCE_MPI="1")
    assert proc.returncode == 0, proc.stderr
    assert "FORCED OK" in proc.stdout


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, None),
        ({"PMI_RANK": "0", "PMI_SIZE": "2"}, "PMI_RANK"),
        ({"OMPI_COMM_WORLD_SIZE": "4"}, "OMPI_COMM_WORLD_SIZE"),
        ({"PMIX_RANK": "1"}, "PMIX_RANK"),
        ({"MPI_LOCALNRANKS": "2"}, "MPI_LOCALNRANKS"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, None),
        ({"SLURM_PROCID": "1", "SLURM_NTASKS": "4"}, "SLURM_PROCID"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "1"}, None),
        ({"XPNN_FORCE_MPI": "1"}, "XPNN_FORCE_MPI"),
        ({"XPNN_FORCE_MPI": "0", "PMI_RANK": "0"}, None),
    ],
)
def test_launcher_detection(env: dict, expected: str | None) -> None:
    assert launched_by_mpi(env) == expected


def test_launcher_detection_bad_force_value() -> None:
    with pytest.raises(UserError, match="XPNN_FORCE_MPI"):
        launched_by_mpi({"XPNN_FORCE_MPI": "yes"})


OPEN_MPI_VERSION = "Open MPI v4.1.6, package: Debian OpenMPI\nmore"  # as MPI reports it


@pytest.mark.parametrize(
    "env, size, var",
    [
        ({"PMI_SIZE": "2"}, 1, "PMI_SIZE"),
        ({"OMPI_COMM_WORLD_SIZE": "4"}, 2, "OMPI_COMM_WORLD_SIZE"),
        ({"MV2_COMM_WORLD_SIZE": "3"}, 1, "MV2_COMM_WORLD_SIZE"),
        ({"PMI_SIZE": "2"}, 2, None),
        ({"PMI_SIZE": "junk", "PMI_RANK": "0"}, 1, None),
        ({"SLURM_NTASKS": "4"}, 1, None),  # a batch script's own variables are no launch
        ({"SLURM_NTASKS": "4", "SLURM_PROCID": "0"}, 1, None),
        # mpiexec in an allocation: srun started one proxy a node, the MPI count settles it
        ({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "PMI_SIZE": "8"}, 8, None),
        ({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1", "PMI_SIZE": "2"}, 2, None),
        ({"SLURM_STEP_ID": "2", "SLURM_STEP_NUM_TASKS": "2", "PMI_SIZE": "2"}, 2, None),  # pmi2
        ({"SLURM_STEP_ID": "1", "SLURM_STEP_NUM_TASKS": "2"}, 2, None),  # srun --mpi=pmix
        ({}, 1, None),
    ],
)
def test_launcher_size_mismatch(env: dict, size: int, var: str | None) -> None:
    """Processes that each see a world of one would each train the whole run alone."""
    if var is None:
        check_launcher_size(size, env, OPEN_MPI_VERSION)
        return
    with pytest.raises(UserError) as err:
        check_launcher_size(size, env, OPEN_MPI_VERSION)
    msg = str(err.value)
    assert f"{var}={env[var]}" in msg and f"MPI sees {size}" in msg, msg
    assert "'Open MPI v4.1.6, package: Debian OpenMPI'" in msg and "MPI4PY_LIBMPI" in msg, msg


@pytest.mark.parametrize("tasks", ["2", "4"])
def test_srun_without_pmi_is_refused(tasks: str) -> None:
    """``srun --mpi=none`` (many sites' default) gives each task a world of one."""
    env = {"SLURM_STEP_ID": "1", "SLURM_STEP_NUM_TASKS": tasks, "SLURM_PROCID": "1"}
    with pytest.raises(UserError) as err:
        check_launcher_size(1, env, "MPICH Version:      5.0.2\nMPICH Release date: x")
    msg = str(err.value)
    assert msg.startswith(f"srun started {tasks} tasks (SLURM_STEP_NUM_TASKS={tasks})"), msg
    assert "MPI sees 1" in msg and "'MPICH Version: 5.0.2'" in msg and "--mpi=pmi2" in msg, msg


# What each process of a launch that cannot form one world sees: the launcher's variables and
# the mpich wheel. Without PMI (``srun -n 2 --mpi=none``) each is a world of one; under PMIx
# (Open MPI's ``mpirun``) the wheel's MPI_Init would abort the process with an error stack.
UNWORLDLY_LAUNCHES = {
    "srun --mpi=none": (
        {"SLURM_NTASKS": "2", "SLURM_STEP_ID": "1", "SLURM_STEP_NUM_TASKS": "2"},
        "SLURM_PROCID",
        "xpnn: srun started 2 tasks",
    ),
    "Open MPI mpirun": (
        {"OMPI_COMM_WORLD_SIZE": "2", "PMIX_NAMESPACE": "prterun-vm-1@1"},
        "OMPI_COMM_WORLD_RANK",
        "xpnn: started through PMIx (PMIX_NAMESPACE is set",
    ),
}


@pytest.mark.mpi
@pytest.mark.parametrize("launch", sorted(UNWORLDLY_LAUNCHES))
@pytest.mark.parametrize("command", [[], ["info"]])
@pytest.mark.parametrize("rank", ["0", "1"])
def test_launch_that_forms_no_world_through_cli(
    tmp_path: Path, launch: str, command: list[str], rank: str
) -> None:
    """Each process exits 2 without training; the one the launcher numbered 0 prints one line."""
    variables, rank_var, line = UNWORLDLY_LAUNCHES[launch]
    args = ["--dataset", "synthetic", "--synthetic-size", "256"] if not command else []
    proc = subprocess.run(
        [sys.executable, "-m", "xpnn", *command, *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=_clean_env(**variables, **{rank_var: rank}),
    )
    assert proc.returncode == 2, proc.stderr
    if rank == "1":
        assert proc.stderr == "" and proc.stdout == ""
        return
    assert proc.stderr.startswith(line) and proc.stderr.count("\n") == 1, proc.stderr
    assert "epoch" not in proc.stdout and "ranks:" not in proc.stdout, proc.stdout


MPICH_WHEEL = "MPICH Version:      5.0.2\nMPICH configure:    --with-pm=hydra:gforker\n"


@pytest.mark.parametrize(
    "env, version, refused",
    [
        ({"PMIX_RANK": "0"}, MPICH_WHEEL, True),
        ({"PMIX_NAMESPACE": "slurm.pmix.7.0"}, MPICH_WHEEL, True),
        ({"PMIX_RANK": "0"}, "MPICH Version: 4.2.0\nMPICH configure: --with-pmix=/usr\n", False),
        ({"PMIX_RANK": "0"}, OPEN_MPI_VERSION, False),
        ({"PMIX_RANK": "0"}, "Intel(R) MPI Library 2021.10 for Linux* OS\n", False),
        ({"PMI_RANK": "0", "PMI_SIZE": "2"}, MPICH_WHEEL, False),
        ({}, MPICH_WHEEL, False),
    ],
)
def test_mpich_without_pmix_under_pmix(env: dict, version: str, refused: bool) -> None:
    if not refused:
        check_pmix(env, version)
        return
    with pytest.raises(UserError) as err:
        check_pmix(env, version)
    msg = str(err.value)
    assert msg.startswith("started through PMIx (PMIX_") and "'MPICH Version: 5.0.2'" in msg
    assert "MPI4PY_LIBMPI" in msg and "--mpi=pmi2" in msg, msg


@pytest.mark.mpi
def test_launcher_size_mismatch_through_cli(tmp_path: Path) -> None:
    """A launcher variable from another MPI than mpi4py's: one line, exit 2, nothing trained."""
    proc = subprocess.run(
        [sys.executable, "-m", "xpnn", "--dataset", "synthetic", "--synthetic-size", "256"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=_clean_env(OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_RANK="0"),
    )
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("xpnn:")]
    assert len(lines) == 1 and "OMPI_COMM_WORLD_SIZE=2" in lines[0], proc.stderr
    assert "MPI sees 1" in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert "epoch" not in proc.stdout, proc.stdout


# -- make_communicator: CPU kinds ------------------------------------------------------------
SINGLE = World(rank=0, size=1, local_rank=0, local_size=1, mpi_comm=None)


@pytest.mark.parametrize("kind", ["auto", "mpi-host", "self"])
def test_single_process_gets_self(kind: str) -> None:
    comm = make_communicator(SINGLE, CPU, kind)
    assert isinstance(comm, SelfCommunicator) and comm.name == "self"
    assert (comm.rank, comm.size, comm.fallback_reason) == (0, 1, None)


@pytest.mark.parametrize("kind", ["mpi-cuda", "nccl"])
def test_device_transport_on_cpu_backend_is_user_error(kind: str) -> None:
    with pytest.raises(UserError, match=f"`comm` {kind}: needs `backend` cupy"):
        make_communicator(SINGLE, CPU, kind)


def test_shared_memory_on_gpu_backend_is_user_error() -> None:
    with pytest.raises(UserError, match="`comm` mpi-shm: needs a CPU backend"):
        make_communicator(SINGLE, GPU, "mpi-shm")


def test_shared_memory_is_for_data_parallelism_only() -> None:
    """The plan names the layout (tests/parallel/test_plan.py); the factory says why."""
    with pytest.raises(UserError, match="`comm` mpi-shm: shares one copy .* split the network"):
        make_communicator(SINGLE, CPU, "mpi-shm", shares_params=False)


def test_unknown_kind_and_self_with_many_ranks() -> None:
    with pytest.raises(UserError, match="`comm` tcp"):
        make_communicator(SINGLE, CPU, "tcp")
    many = World(rank=0, size=2, local_rank=0, local_size=2, mpi_comm=None)
    with pytest.raises(UserError, match="`comm` self"):
        make_communicator(many, CPU, "self")


def test_self_communicator_is_identity() -> None:
    comm = SelfCommunicator()
    buf = np.arange(5, dtype=np.float32)
    comm.allreduce_(buf, "max")
    comm.iallreduce_(buf).wait()
    comm.bcast_(buf)
    comm.barrier()
    assert np.array_equal(buf, np.arange(5, dtype=np.float32))
    out = comm.allreduce_host(np.array([3, 4], dtype=np.int32))
    assert out.dtype == np.float64 and out.tolist() == [3.0, 4.0]
    assert comm.allgather_obj({"a": 1}) == [{"a": 1}]
    comm.ireduce_scatter_(buf, [5]).wait()
    comm.allgather_(buf, [5])
    assert np.array_equal(buf, np.arange(5, dtype=np.float32))
    with pytest.raises(ValueError, match="piece sizes"):
        comm.allgather_(buf, [4])
    with pytest.raises(ValueError, match="prod"):
        comm.allreduce_(buf, "prod")
    assert comm.bytes_sent == 0  # one process hands nothing to a transport
    with pytest.raises(SystemExit) as exc:
        comm.abort(3)
    assert exc.value.code == 3


BYTES_SENT = """
import sys
import numpy as np
from xpnn.parallel.comm import MpiHostCommunicator, ShmCommunicator
from xpnn.runtime import init_world, run_guarded

def main():
    w = init_world()
    for comm in (MpiHostCommunicator(w.mpi_comm), ShmCommunicator.create(w.mpi_comm)):
        root = comm.rank == 0
        comm.allreduce_(np.ones(10))  # 80 bytes from every rank
        comm.iallreduce_(np.ones(5, np.float32)).wait()  # 20
        comm.bcast_(np.ones(3), root=0)  # 24 from the root, nothing from the others
        comm.allreduce_host([1, 2])  # 16: float64 whatever the values' type
        comm.ireduce_scatter_(np.ones(6), [2, 4]).wait()  # the other rank's piece: 32 or 16
        comm.allgather_(np.ones(6), [2, 4])  # its own piece: 16 or 32, one buffer's in all
        if root:
            comm.isend(np.ones(4, np.int64), dest=1).wait()  # 32 from the sender
        else:
            comm.recv_(np.empty(4, np.int64), source=0)  # the sender counted it
        comm.barrier()
        comm.allgather_obj("setup")
        want = 80 + 20 + 16 + 48 + (24 + 32 if root else 0)
        assert comm.bytes_sent == want, (comm.name, comm.bytes_sent, want)
    print(f"OK rank {w.rank}", flush=True)

sys.exit(run_guarded(init_world(), main))
"""


@pytest.mark.mpi
def test_communicators_count_the_bytes_this_rank_sends(tmp_path: Path) -> None:
    proc, _ = run_script(tmp_path, BYTES_SENT, 2, timeout=60)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "OK rank 0" in proc.stdout and "OK rank 1" in proc.stdout


# -- GPU transport choice: pure rules, no GPU needed -------------------------------------------
def _info(host: str, bus: str, device: int, nccl: bool = True, aware: bool = False) -> dict:
    return {
        "host": host,
        "device": device,
        "gpu": (host, bus),
        "nccl": nccl,
        "nccl_why": "" if nccl else "cupy.cuda.nccl is not available",
        "aware": aware,
        "aware_why": "XPNN_CUDA_AWARE=1" if aware else "MPIX_Query_cuda_support() = 0",
    }


def test_gpu_choice_rules() -> None:
    own = [_info("a", "0000:01:00.0", 0), _info("a", "0000:02:00.0", 1)]
    shared = [_info("a", "0000:01:00.0", 0), _info("a", "0000:01:00.0", 0)]
    # same bus id on different hosts is not sharing
    two_hosts = [_info("a", "0000:01:00.0", 0), _info("b", "0000:01:00.0", 0)]
    assert shared_gpu(own) is None and shared_gpu(two_hosts) is None
    assert shared_gpu(shared) == (0, 1, 0)

    assert choose_gpu_kind(own, "auto")[:2] == ("nccl", None)
    assert choose_gpu_kind(two_hosts, "auto")[:2] == ("nccl", None)
    assert choose_gpu_kind(shared, "auto")[:2] == ("mpi-host", None)
    aware_shared = [dict(i, aware=True) for i in shared]
    assert choose_gpu_kind(aware_shared, "auto")[:2] == ("mpi-cuda", None)
    no_nccl = [_info("a", "0000:01:00.0", 0, nccl=False), _info("a", "0000:02:00.0", 1)]
    assert choose_gpu_kind(no_nccl, "auto")[0] == "mpi-host"

    name, reason, _ = choose_gpu_kind(shared, "nccl")
    assert name == "mpi-host"
    assert reason == (
        "`comm` nccl: ranks 0 and 1 share GPU 0 (NCCL refuses that); falling back to mpi-host"
    )
    assert choose_gpu_kind(aware_shared, "nccl")[0] == "mpi-cuda"
    name, reason, _ = choose_gpu_kind(no_nccl, "nccl")
    assert name == "mpi-host" and "nccl is not available" in reason

    name, reason, _ = choose_gpu_kind(own, "mpi-cuda")
    assert name == "mpi-host"
    assert reason.startswith("`comm` mpi-cuda: MPI is not CUDA-aware (MPIX_Query_cuda_support")
    assert reason.endswith("falling back to mpi-host")
    assert choose_gpu_kind([dict(i, aware=True) for i in own], "mpi-cuda")[:2] == (
        "mpi-cuda",
        None,
    )
    # one rank not aware is enough to stage everywhere (all ranks must take the same path)
    mixed = [dict(own[0], aware=True), own[1]]
    assert choose_gpu_kind(mixed, "mpi-cuda")[0] == "mpi-host"
    assert choose_gpu_kind(own, "mpi-host")[:2] == ("mpi-host", None)


# -- failure handling, single process ------------------------------------------------------------
def test_run_guarded_single_process(capsys: pytest.CaptureFixture) -> None:
    assert run_guarded(SINGLE, lambda: None) == 0
    assert run_guarded(SINGLE, lambda: 5) == 5

    def user() -> None:
        raise UserError("--lr -1: must be positive\nsecond line")

    def bug() -> None:
        raise ZeroDivisionError("boom")

    assert run_guarded(SINGLE, user) == 2
    assert capsys.readouterr().err == "xpnn: --lr -1: must be positive | second line\n"
    assert run_guarded(SINGLE, bug) == 1
    assert capsys.readouterr().err == "xpnn: ZeroDivisionError: boom\n"


def test_agree_on_user_errors_single_process(capsys: pytest.CaptureFixture) -> None:
    assert agree_on_user_errors(SINGLE, lambda: 42) == 42

    def user() -> None:
        raise UserError("data/x.gz: missing")

    # alone there is nothing to agree on: the error reaches the caller (a program gets the
    # UserError), and under run_guarded, as the command line runs it, it is one line and exit 2
    with pytest.raises(UserError, match="data/x.gz: missing"):
        agree_on_user_errors(SINGLE, user)
    assert capsys.readouterr().err == ""
    assert run_guarded(SINGLE, lambda: agree_on_user_errors(SINGLE, user)) == 2
    assert capsys.readouterr().err == "xpnn: data/x.gz: missing\n"


# -- failure handling under mpiexec --------------------------------------------------------------
# Rank 0 names MPICH's node segment files that it maps, by their names, removed or not.
PRINT_SEGMENTS = """
if w.rank == 0:
    for line in open("/proc/self/maps"):
        path = line.split(maxsplit=5)[5:] or [""]
        if path[0].startswith("/dev/shm/mpich_shm_"):
            print("segment", path[0].split()[0], flush=True)
"""


def assert_segments_gone(stdout: str) -> None:
    """A job that ended by MPI_Abort or a killed rank never ran MPI_Finalize, which is where
    MPICH removes its /dev/shm file; xpnn removes the name at start-up instead
    (``segments``). The mpich wheel always has such a segment for two ranks."""
    paths = {line.split()[1] for line in stdout.splitlines() if line.startswith("segment ")}
    assert paths, "no MPICH segment found in /proc/self/maps"
    assert not [path for path in paths if os.path.exists(path)]


RANK1_RAISES = """
import sys, time
import numpy as np
from xpnn.parallel.comm import make_communicator
from xpnn.runtime import init_world, run_guarded
from types import SimpleNamespace

w = init_world()
{print_segments}
def train():
    comm = make_communicator(w, SimpleNamespace(name="numpy", is_gpu=False, xp=np))
    buf = np.ones(1000, np.float32)
    for step in range(1000):
        if w.rank == 1 and step == 3:
            raise ValueError("exploding gradient")
        comm.allreduce_(buf)  # rank 0 waits here forever unless rank 1's failure stops it
        time.sleep(0.01)

sys.exit(run_guarded(w, train))
"""


@pytest.mark.mpi
def test_one_rank_raising_stops_the_job(tmp_path: Path) -> None:
    proc, seconds = run_script(tmp_path, RANK1_RAISES.format(print_segments=PRINT_SEGMENTS), 2)
    assert proc.returncode != 0
    assert seconds < 30
    assert proc.stderr.count("rank 1:") == 1, proc.stderr
    assert "rank 1: ValueError: exploding gradient" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert_segments_gone(proc.stdout)


USER_ERROR = """
import sys
from xpnn.errors import UserError
from xpnn.runtime import agree_on_user_errors, init_world, run_guarded

w = init_world()
WHO = {who}

def setup():
    if w.rank in WHO:
        raise UserError("--data-dir /nope: no such directory")
    return "ready"

def main():
    assert agree_on_user_errors(w, setup) == "ready"
    print("trained", flush=True)

sys.exit(run_guarded(w, main))
"""


@pytest.mark.mpi
def test_user_error_on_all_ranks_printed_once(tmp_path: Path) -> None:
    proc, seconds = run_script(tmp_path, USER_ERROR.format(who="(0, 1)"), 2)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == "xpnn: --data-dir /nope: no such directory\n"
    assert "trained" not in proc.stdout
    assert seconds < 30


@pytest.mark.mpi
def test_user_error_on_one_rank_names_it(tmp_path: Path) -> None:
    proc, _ = run_script(tmp_path, USER_ERROR.format(who="(1,)"), 2)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == "xpnn: rank 1: --data-dir /nope: no such directory\n"


@pytest.mark.mpi
def test_no_error_runs_on(tmp_path: Path) -> None:
    proc, _ = run_script(tmp_path, USER_ERROR.format(who="()"), 2)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("trained") == 2


SIGKILL = """
import os, sys
import numpy as np
from xpnn.parallel.comm import make_communicator
from xpnn.runtime import init_world, run_guarded
from types import SimpleNamespace

w = init_world()
{print_segments}
comm = make_communicator(w, SimpleNamespace(name="numpy", is_gpu=False, xp=np))
buf = np.ones(10, np.float64)
comm.allreduce_(buf)
if w.rank == 1:
    os.kill(os.getpid(), 9)
comm.allreduce_(buf)  # rank 0 waits for a rank that is gone
print("should not get here", flush=True)
"""


@pytest.mark.mpi
def test_killed_rank_ends_the_job(tmp_path: Path) -> None:
    proc, seconds = run_script(tmp_path, SIGKILL.format(print_segments=PRINT_SEGMENTS), 2)
    assert proc.returncode != 0
    assert seconds < 30
    assert "should not get here" not in proc.stdout
    assert_segments_gone(proc.stdout)


STUCK_IN_SETUP = """
import sys
from xpnn.errors import UserError
from xpnn.runtime import agree_on_user_errors, init_world, run_guarded

w = init_world()

def setup():
    if w.rank == 1:
        raise UserError("--data-dir /node1/data: no such directory")
    w.mpi_comm.allgather("gpu facts")  # rank 0 waits here for rank 1, which never comes
    return "ready"

def main():
    agree_on_user_errors(w, setup)
    print("trained", flush=True)

sys.exit(run_guarded(w, main))
"""


@pytest.mark.mpi
def test_rank_failing_before_a_setup_collective_aborts(tmp_path: Path) -> None:
    proc, seconds = run_script(tmp_path, STUCK_IN_SETUP, 2, XPNN_AGREE_TIMEOUT="1")
    assert proc.returncode == 2, proc.stderr
    assert seconds < 20
    assert proc.stderr.count("rank 1: --data-dir /node1/data: no such directory") == 1
    assert "trained" not in proc.stdout
