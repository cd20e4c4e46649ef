"""Two Slurm nodes on this host (n1, n2; the wheel's MPICH over UCX between them): every
layout trains what one rank trains (float64, <= 1e-9 relative); a rank killed on one node ends
the job on both; a rank stopped on the other node is named by the stall watch."""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest
from conftest import TINY_FLOAT64_RUN, train_and_load
from parallel.model.test_gpt_parallel import gpt_args, write_text

from xpnn.runtime.world import describe_ranks

from .conftest import job_ids, job_ranks, load_params, wait_until

pytestmark = pytest.mark.mpi

# (ranks per node, flags): each on 2 nodes
LAYOUTS = {
    "tensor-2x1": (1, ["--parallel", "tensor"]),
    "pipeline-2x1": (1, ["--parallel", "pipeline", "--microbatches", "2"]),
    "batch-threads-2x1": (1, ["--threads", "2", "--batch-threads", "2"]),
    "shm-gradients-2x2": (2, ["--comm", "mpi-shm", "--node-share", "gradients"]),
    "shm-activations-2x2": (2, ["--comm", "mpi-shm", "--node-share", "activations"]),
    "host-2x2": (2, ["--comm", "mpi-host"]),
    "2d-tensor-2x2": (2, ["--parallel", "tensor", "--model-ranks", "2"]),
    # ZeRO stage 1 (over mpi-host: node-shared memory keeps one copy a node already)
    "shard-optimizer-2x2": (2, ["--shard-optimizer"]),
}
UPDATES = {
    "shm-gradients-2x2": "shared gradients",
    "shm-activations-2x2": "shared activations",
    "shard-optimizer-2x2": "sharded",
}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    params, records, _ = train_and_load(tmp_path_factory.mktemp("one"), 1, TINY_FLOAT64_RUN)
    return params, records


def _on_two_nodes(cluster, tmp_path, per_node: int, args: list[str]):
    """``srun -N 2 --ntasks-per-node=PER_NODE --mpi=pmi2``: (parameters, metrics records)."""
    saved, metrics = tmp_path / "p.npz", tmp_path / "m.jsonl"
    proc = cluster.srun(
        ["-N", "2", f"--ntasks-per-node={per_node}", "--mpi=pmi2"],
        [*args, "--save", str(saved), "--metrics", str(metrics)],
    )
    assert proc.returncode == 0, proc.stderr
    assert f"2 node(s) x {per_node} rank(s)" in proc.stdout, proc.stdout
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert records[-1]["world_size"] == 2 * per_node and records[-1]["ranks_agree"]
    return load_params(saved), records


def _assert_close(got: dict, want: dict) -> None:
    """Float64, <= 1e-9 relative to each parameter's largest value."""
    assert got.keys() == want.keys()
    for key in want:
        scale = np.abs(want[key]).max()
        np.testing.assert_allclose(got[key], want[key], rtol=1e-9, atol=1e-9 * scale, err_msg=key)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_two_nodes_train_what_one_rank_trains(cluster, one_rank, tmp_path, name):
    per_node, flags = LAYOUTS[name]
    got, records = _on_two_nodes(cluster, tmp_path, per_node, [*TINY_FLOAT64_RUN, *flags])
    want, want_records = one_rank
    _assert_close(got, want)
    assert records[-1]["test_loss"] == pytest.approx(want_records[-1]["test_loss"], rel=1e-9)
    if name in UPDATES:
        assert records[-1]["update"] == UPDATES[name]


def test_three_d_over_two_nodes_trains_what_one_rank_trains(cluster, tmp_path):
    """The GPT (the model with splits inside its layers): 2 replicas x 2 stages x 2 tensor
    parts, a replica on each node."""
    args = gpt_args(write_text(tmp_path / "corpus.txt"))
    want, want_records, _ = train_and_load(tmp_path, 1, args)
    three_d = ["--parallel", "pipeline", "--tensor-ranks", "2", "--model-ranks", "4"]
    got, records = _on_two_nodes(cluster, tmp_path, 4, [*args, *three_d])
    _assert_close(got, want)
    assert records[0]["test_loss"] == pytest.approx(want_records[0]["test_loss"], rel=1e-9)


LONG = [*TINY_FLOAT64_RUN, "--hidden", "16", "--epochs", "100000"]
BOUND_S = 30.0


def _started(cluster, tmp_path, extra=()):
    """A 2-node x 1-rank job past its second epoch: (srun, its output file, {node: pid})."""
    out = tmp_path / "job.out"
    opts = ["-N", "2", "--ntasks-per-node=1", "--mpi=pmi2", "--kill-on-bad-exit=1"]
    job = cluster.start_running(opts, [*LONG, *extra], out, "epoch 2/")
    assert job.poll() is None, out.read_text()
    ids = wait_until(lambda: job_ids(cluster), 10, "the job in the queue")
    ranks = wait_until(lambda: len(job_ranks(ids[0])) == 2 and job_ranks(ids[0]), 10, "ranks")
    return job, out, {node: pid for (node, _), pid in ranks.items()}


def _ended(job, out) -> tuple[int, float]:
    start = time.monotonic()
    try:
        code = job.wait(timeout=BOUND_S + 30)
    finally:
        if job.poll() is None:
            job.kill()
    return code, time.monotonic() - start


def test_a_rank_killed_on_one_node_ends_the_job_on_both(cluster, tmp_path):
    """Under ``srun --kill-on-bad-exit=1`` (the batch scripts'): without it, or the cluster's
    ``KillOnBadExit=1``, srun lets the other ranks wait for the dead one."""
    job, out, pids = _started(cluster, tmp_path)
    os.kill(pids["n2"], signal.SIGKILL)
    code, seconds = _ended(job, out)
    assert code != 0, out.read_text()
    assert seconds < BOUND_S, out.read_text()
    wait_until(lambda: not any(_alive(pid) for pid in pids.values()), 10, "the ranks to end")


def test_a_rank_stopped_on_the_other_node_is_named(cluster, tmp_path):
    job, out, pids = _started(cluster, tmp_path, ["--stall-warn", "1", "--stall-abort", "2"])
    os.kill(pids["n2"], signal.SIGSTOP)  # rank 1, on n2
    code, seconds = _ended(job, out)
    text = out.read_text()
    assert code != 0, text
    assert seconds < BOUND_S, text
    assert "xpnn: stalled: rank 0 waited 2 s for rank 1" in text, text
    wait_until(lambda: not any(_alive(pid) for pid in pids.values()), 10, "the ranks to end")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def test_info_says_nodes_x_ranks(cluster):
    proc = cluster.srun(["-N", "2", "--ntasks-per-node=2", "--mpi=pmi2"], ["info"])
    assert proc.returncode == 0, proc.stderr
    assert "ranks: 4 (2 node(s) x 2 rank(s); 2 on this node)" in proc.stdout, proc.stdout


def test_ranks_are_described_by_node():
    assert describe_ranks(4, (4,)) == "4 rank(s)"
    assert describe_ranks(4, (2, 2)) == "2 node(s) x 2 rank(s)"
    assert describe_ranks(3, (2, 1)) == "3 rank(s) on 2 node(s) (2, 1)"


@pytest.mark.parametrize(
    ("opts", "threads"),
    [([], 1), (["--cpus-per-task=2"], 2)],
    ids=["one-cpu-a-task", "cpus-per-task-2"],
)
def test_threads_per_rank_come_from_the_allocation(cluster, tmp_path, opts, threads):
    """Both nodes are this host: each rank's affinity mask holds all its cores, and taking
    them all would run 2 x that many threads; the allocation says how many are the rank's."""
    i = TINY_FLOAT64_RUN.index("--threads")
    args = [*TINY_FLOAT64_RUN[:i], *TINY_FLOAT64_RUN[i + 2 :], "--epochs", "1"]
    threads = min(threads, len(os.sched_getaffinity(0)))  # the host's cores cap it
    metrics = tmp_path / "m.jsonl"
    proc = cluster.srun(
        ["-N", "2", "--ntasks-per-node=1", "--mpi=pmi2", *opts],
        [*args, "--metrics", str(metrics)],
    )
    assert proc.returncode == 0, proc.stderr
    assert f"2 node(s) x 1 rank(s) x {threads} thread(s)" in proc.stdout, proc.stdout
    assert json.loads(metrics.read_text().splitlines()[-1])["threads"] == threads
