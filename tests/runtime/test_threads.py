"""Threads per rank: the arithmetic, the flag check, and the limits really applied."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT, mpiexec_path

from xpnn.errors import UserError
from xpnn.runtime.threads import (
    allocated_cpus,
    core_share,
    cpu_quota,
    node_cores,
    quota_cores,
    threads_per_rank,
)


@pytest.mark.parametrize(
    "local_size, cores, expected",
    [(1, 8, 8), (2, 8, 4), (3, 8, 2), (4, 2, 1), (16, 2, 1), (2, 2, 1), (1, 1, 1), (5, 64, 12)],
)
def test_cores_divided_among_node_ranks(local_size: int, cores: int, expected: int) -> None:
    assert threads_per_rank(local_size, cores=cores) == expected


def test_override_wins_and_is_checked() -> None:
    assert threads_per_rank(4, cores=2, override=3) == 3
    for bad in (0, -2, 1.5, True):
        with pytest.raises(UserError, match="`threads`"):
            threads_per_rank(1, cores=4, override=bad)  # type: ignore[arg-type]


def test_default_cores_from_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    limit = quota_cores(cpu_quota())  # None here; a container's quota where CI has one
    cores = len(os.sched_getaffinity(0))
    assert node_cores() == (cores if limit is None else min(cores, limit))
    assert threads_per_rank(1) == max(1, node_cores())


def test_slurm_cpus_per_task(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "6")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    assert threads_per_rank(4, share=6) == 6
    assert threads_per_rank(4, cores=8) == 2  # explicit cores: plain arithmetic


def test_slurm_cpus_per_task_is_capped_by_the_ranks_own_cores(monkeypatch: pytest.MonkeyPatch):
    """Ranks that mpiexec started inside an ``sbatch -c 2`` job inherit the variable: 2 ranks
    on 2 cores took 2 threads each, and the note blamed a --threads nobody gave."""
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "2")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    assert threads_per_rank(2, share=1) == 1
    monkeypatch.setattr("xpnn.runtime.threads.node_cores", lambda: 1)  # taskset -c 0
    assert threads_per_rank(1) == 1


def test_thread_variables_the_run_overrides_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """``OMP_NUM_THREADS=1`` (exported for every program, as HPC users do) must not be replaced
    by the default without a word: the command line notes it (``REPLACED_ENV``)."""
    import xpnn.runtime.threads as threads

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MKL_NUM_THREADS", "2")  # what the run uses: nothing to say
    monkeypatch.setenv("NUMBA_NUM_THREADS", "2")  # restored afterwards, whatever the run sets
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    monkeypatch.setitem(__import__("sys").modules, "threadpoolctl", None)  # limit nothing here
    monkeypatch.delitem(__import__("sys").modules, "numba", raising=False)  # nor Numba's pool
    threads.apply_threads(2)
    assert threads.REPLACED_ENV == {"OMP_NUM_THREADS": "1"}


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "SLURM_"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_apply_threads_limits_blas_and_numba() -> None:
    """In a child: limits set here would slow the rest of the test session."""
    code = textwrap.dedent(
        """
        import numba, numpy
        from threadpoolctl import threadpool_info
        from xpnn.runtime.threads import apply_threads
        info = apply_threads(1)
        assert info["threads"] == 1, info
        assert info["numba"] == 1 and numba.get_num_threads() == 1, info
        pools = threadpool_info()
        # NumPy's BLAS is found (threadpoolctl < 3.5 sees none in NumPy 2's wheels, and an
        # empty list passed the check below: two ranks then ran every core's worth each)
        assert any(p["user_api"] == "blas" for p in pools), pools
        assert all(p["num_threads"] == 1 for p in pools), pools
        assert info["blas"] and [p["threads"] for p in info["blas"]] == [1] * len(info["blas"])
        print("LIMITED", info)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=_child_env()
    )
    assert proc.returncode == 0, proc.stderr
    assert "LIMITED" in proc.stdout


def test_apply_threads_before_numba_import() -> None:
    code = textwrap.dedent(
        """
        import sys
        from xpnn.runtime.threads import apply_threads
        info = apply_threads(1)
        assert "numba" not in sys.modules
        import numba
        assert numba.get_num_threads() == 1
        print("DEFERRED", info["numba"])
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=_child_env()
    )
    assert proc.returncode == 0, proc.stderr
    assert "DEFERRED 1" in proc.stdout


@pytest.mark.mpi
def test_two_ranks_share_the_node(tmp_path) -> None:
    script = tmp_path / "threads.py"
    script.write_text(
        textwrap.dedent(
            """
            from xpnn.runtime import init_world, threads_per_rank
            from xpnn.runtime.threads import node_cores
            w = init_world()
            cores = node_cores()  # the affinity mask, or a container's CPU quota
            print(f"rank {w.rank} local_size {w.local_size} cores {cores} "
                  f"threads {threads_per_rank(w.local_size)}", flush=True)
            """
        )
    )
    proc = subprocess.run(
        [mpiexec_path(), "-n", "2", sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env=_child_env(),
    )
    assert proc.returncode == 0, proc.stderr
    # the launcher merges both ranks' output, lines may run together: match, don't split
    found = re.findall(r"rank (\d) local_size (\d+) cores (\d+) threads (\d+)", proc.stdout)
    assert sorted(int(f[0]) for f in found) == [0, 1], proc.stdout
    for _, local_size, cores, threads in ((int(x) for x in f) for f in found):
        assert local_size == 2
        assert threads == max(1, cores // 2)
        if cores == 2:  # this project's 2-core CI machine: one thread each
            assert threads == 1


def _cores(*ids: int) -> frozenset[int]:
    return frozenset(ids)


@pytest.mark.parametrize(
    "node, me, expected",
    [
        ([_cores(0, 1, 2, 3)] * 2, 0, (2, False)),  # no binding (MPICH): 4 cores, 2 ranks
        ([_cores(0), _cores(1)], 1, (1, False)),  # Open MPI's default for 2 ranks: a core each
        ([_cores(0, 1, 2, 3), _cores(4, 5, 6, 7)], 0, (4, False)),  # srun --cpu-bind: 4 each
        ([_cores(0, 1, 2, 3)] * 2 + [_cores(4, 5, 6, 7)], 2, (4, False)),  # by socket, uneven
        ([_cores(0, 1, 2, 3)] * 2 + [_cores(4, 5, 6, 7)], 0, (2, False)),
        ([_cores(0, 1)] * 3, 0, (1, True)),  # 3 ranks on 2 cores: crowded
    ],
)
def test_a_ranks_cores_are_shared_only_with_the_ranks_that_can_run_on_them(node, me, expected):
    assert core_share(node[me], node) == expected


def test_the_share_decides_the_default_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    assert threads_per_rank(2, share=4) == 4  # bound: all of its own, not 4 // 2
    assert threads_per_rank(2, share=4, override=1) == 1


@pytest.mark.parametrize(
    ("env", "local_size", "expected"),
    [
        ({}, 2, None),  # outside Slurm
        ({"SLURM_JOB_ID": "7", "SLURM_CPUS_ON_NODE": "1"}, 1, 1),  # srun -N 2 -n 2: 1 a node
        ({"SLURM_JOB_ID": "7", "SLURM_CPUS_ON_NODE": "8"}, 2, 4),  # the node's CPUs shared
        ({"SLURM_JOB_ID": "7", "SLURM_CPUS_ON_NODE": "3"}, 4, 1),  # never below 1
        ({"SLURM_CPUS_ON_NODE": "8"}, 1, None),  # a variable left over, no job
        ({"SLURM_JOB_ID": "7", "SLURM_CPUS_ON_NODE": "8", "SLURM_CPUS_PER_TASK": "3",
          "SLURM_STEP_ID": "0"}, 2, 3),  # srun -c 3, or mpiexec inside sbatch -c 3
        ({"SLURM_JOB_ID": "7", "SLURM_CPUS_ON_NODE": "x"}, 1, None),
    ],
)  # fmt: skip
def test_allocated_cpus(env, local_size, expected):
    assert allocated_cpus(local_size, env) == expected


def test_the_allocation_caps_the_affinity_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two slurmd on one host of 2 cores, a rank on each: each rank's mask holds both cores,
    its node's allocation one CPU; 1 thread each, not 2 (4 threads on 2 cores)."""
    for var in ("SLURM_CPUS_PER_TASK", "SLURM_STEP_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_CPUS_ON_NODE", "1")
    assert threads_per_rank(1, share=2) == 1
    monkeypatch.setattr("xpnn.runtime.threads.node_cores", lambda: 2)
    assert threads_per_rank(1) == 1
    monkeypatch.setenv("SLURM_CPUS_ON_NODE", "4")  # a larger allocation: the mask caps it
    assert threads_per_rank(1) == 2
