"""Under a real Slurm, ``srun --mpi=pmi2`` and ``sbatch`` with ``mpiexec`` inside train what
``mpiexec -n 2`` trains (float64); ``srun`` without an MPI plugin the wheel speaks is refused
in one line. The batch scripts are ci/slurm/*.sbatch, as docs/cluster.md quotes them."""

from __future__ import annotations

import time

import pytest
from conftest import TINY_FLOAT64_RUN, train_and_load

from . import conftest as slurm
from .conftest import assert_same_params, load_params

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """``mpiexec -n 2`` on this host, outside Slurm."""
    params, _, _ = train_and_load(tmp_path_factory.mktemp("ref"), 2, TINY_FLOAT64_RUN)
    return params


def test_srun_pmi2_trains_what_mpiexec_trains(cluster, reference, tmp_path):
    saved = tmp_path / "srun.npz"
    proc = cluster.srun(
        ["-N", "1", "-n", "2", "--mpi=pmi2"], [*TINY_FLOAT64_RUN, "--save", str(saved)]
    )
    assert proc.returncode == 0, proc.stderr
    assert "2 rank(s)" in proc.stdout
    assert_same_params(load_params(saved), reference)


@pytest.mark.parametrize("script", ["train-srun.sbatch", "train-mpiexec.sbatch"])
def test_batch_scripts_train_what_mpiexec_trains(cluster, reference, tmp_path, script):
    saved = tmp_path / "job.npz"
    state, out = cluster.sbatch(
        script,
        ["--nodes=1", "--ntasks-per-node=2"],
        [*TINY_FLOAT64_RUN, "--save", str(saved)],
        tmp_path / "job.out",
    )
    assert state == "COMPLETED 0:0", out
    assert "2 rank(s)" in out, out
    assert_same_params(load_params(saved), reference)


@pytest.mark.parametrize("plugin", ["none", "cray_shasta"])
def test_srun_without_pmi2_is_refused_in_one_line(cluster, plugin):
    proc = cluster.srun(["-N", "1", "-n", "2", f"--mpi={plugin}"], TINY_FLOAT64_RUN)
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("xpnn:")]
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(ours) == 1, proc.stderr
    assert "srun --mpi=pmi2" in ours[0], proc.stderr


def test_a_start_refused_by_pmi2_is_started_again_without_waiting(cluster, monkeypatch):
    """slurmstepd's refusal of a PMI-2 request leaves the rank waiting in ``MPI_Init``: the
    tests give such a start up ``BROKEN_S`` after the refusal, not ``HUNG_S`` after its start;
    one whose xpnn header follows runs to its end."""
    monkeypatch.setattr(slurm, "BROKEN_S", 0.5)
    refused = "slurmstepd: error: mpi/pmi2: value not properly terminated in client request"
    start = time.monotonic()
    assert cluster._unless_hung(["bash", "-c", f"echo '{refused}' >&2; exec sleep 60"]) is None
    assert time.monotonic() - start < 15
    # the same for a job left running (``start_running``, ``submit_running``): its output
    never = lambda: False  # noqa: E731 - the job runs on
    assert slurm._poll(slurm._said(lambda: refused, "epoch 2/", never), 5)
    assert not slurm._poll(slurm._said(lambda: f"{refused}\nxpnn: header", "epoch 2/", never), 1)
    late = f"echo '{refused}' >&2; echo 'xpnn: header'; sleep 0.3; echo done"
    proc = cluster._unless_hung(["bash", "-c", late])
    assert proc is not None and proc.returncode == 0 and proc.stdout.endswith("done\n")
