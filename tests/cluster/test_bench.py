"""The scaling study over two Slurm nodes on one host: ``XPNN_MPIEXEC`` names the launcher
that spreads the ranks over the nodes, and ``XPNN_BENCH_SETUP`` labels the rows."""

from __future__ import annotations

import json
import subprocess

import pytest
from conftest import run_bench

from .conftest import HUNG_S, SCRIPTS, START_FAILURES, START_TRIES

pytestmark = pytest.mark.mpi

LABEL = "two nodes on one host, UCX between them"


def test_the_scaling_study_runs_over_two_nodes(cluster, tmp_path):
    out = tmp_path / "scaling.jsonl"
    env = {
        **cluster.env,
        "XPNN_MPIEXEC": str(SCRIPTS / "mpiexec-over-nodes"),
        "XPNN_BENCH_SETUP": LABEL,
    }
    args = ["scaling", "--quick", "--ranks", "2", "--modes", "strong", "--repeats", "1"]
    proc = None
    for _ in range(START_TRIES):  # a start-up the PMI-2 exchange broke (conftest's retry)
        out.unlink(missing_ok=True)
        try:
            proc = run_bench(*args, "--out", str(out), env=env, timeout=3 * HUNG_S)
        except subprocess.TimeoutExpired:  # its runs' MPI_Init hung: cancelled, again
            cluster.cancel_all()
            continue
        broken = (*START_FAILURES, "waiting in MPI_Init")
        if proc.returncode == 0 or not any(said in proc.stderr for said in broken):
            break
    assert proc is not None, "every start of the study hung in MPI_Init"
    assert proc.returncode == 0, proc.stderr
    assert LABEL in proc.stdout
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["machine"]["setup"] == LABEL
    assert record["config"]["ranks"] == 2
