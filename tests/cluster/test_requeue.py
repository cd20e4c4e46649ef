"""Requeue under Slurm, end to end, with the batch script docs/cluster.md quotes
(ci/slurm/requeue.sbatch): a job signalled mid-epoch puts itself back in the queue, resumes,
and ends with the parameters and metrics of a run never stopped (signalled while it starts:
test_requeue_start.py). And which signals reach the ranks under ``sbatch`` + ``mpiexec``."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from .conftest import load_params, wait_until

pytestmark = pytest.mark.mpi

# 6000 samples in batches of 70: 86 steps an epoch; 4 epochs of a 512-wide layer: seconds
# on an idle machine, long enough to be signalled inside an epoch after the first
RUN = [
    "--dataset", "synthetic", "--synthetic-size", "6000", "--epochs", "4", "--batch-size", "70",
    "--dtype", "float64", "--optimizer", "adam", "--lr", "0.01", "--hidden", "512",
    "--threads", "1", "--no-progress",
]  # fmt: skip
SAME = ("epoch", "train_loss", "train_acc", "test_loss", "test_acc", "lr")  # not timings
DONE = ("epochs", "steps", "test_loss", "test_acc", "params_sha256")


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _signal_after_epoch_one(cluster, job: str, out, signal: str) -> None:
    wait_until(lambda: out.exists() and "epoch 1/" in out.read_text(), 120, "epoch 1's end")
    proc = cluster.run(["scancel", "-s", signal, job])  # the steps' tasks, not the batch shell
    assert proc.returncode == 0, proc.stderr


def test_a_signalled_job_requeues_and_ends_as_if_never_stopped(cluster, tmp_path):
    whole, whole_metrics = tmp_path / "whole.npz", tmp_path / "whole.jsonl"
    proc = cluster.srun(
        ["-N", "1", "-n", "2", "--mpi=pmi2"],
        [*RUN, "--save", str(whole), "--metrics", str(whole_metrics)],
    )
    assert proc.returncode == 0, proc.stderr

    saved, metrics, out = tmp_path / "p.npz", tmp_path / "m.jsonl", tmp_path / "job.out"
    args = [str(tmp_path / "ck"), *RUN, "--save", str(saved), "--metrics", str(metrics)]
    job = cluster.submit("requeue.sbatch", [], args, out)
    _signal_after_epoch_one(cluster, job, out, "USR1")
    state = cluster.wait_job(job)
    text = out.read_text()  # --open-mode=append: both runs' output
    assert state == "COMPLETED 0:0", text
    assert cluster.job(job)["Restarts"] == "1", text
    assert re.search(r"xpnn: SIGUSR1: checkpoint at step \d+ \(\d+ of epoch \d's", text), text
    assert "resume: " in text and "(epoch 1, step" in text, text

    _assert_as_if_never_stopped(saved, metrics, whole, whole_metrics)


def _assert_as_if_never_stopped(saved, metrics, whole, whole_metrics) -> None:
    """The parameters bit for bit, and every record but timings, each epoch's once."""
    want, got = load_params(whole), load_params(saved)
    assert want.keys() == got.keys()
    for key in want:
        assert np.array_equal(got[key], want[key]), key  # bit-exact
    records, want_records = _records(metrics), _records(whole_metrics)
    epochs = [r.get("epoch") for r in want_records if r["event"] == "epoch"]
    assert [r.get("epoch") for r in records if r["event"] == "epoch"] == epochs
    assert len(records) == len(want_records)
    for mine, theirs in zip(records, want_records, strict=True):
        keys = SAME if theirs["event"] == "epoch" else DONE
        assert {k: mine.get(k) for k in keys} == {k: theirs.get(k) for k in keys}


@pytest.mark.parametrize(
    ("signal", "state"),
    [("USR1", "FAILED 75:0"), ("USR2", "FAILED 255:0")],
    ids=["usr1-reaches-the-ranks", "usr2-ends-hydra"],
)
def test_signals_under_sbatch_and_mpiexec(cluster, tmp_path, signal, state):
    """The step is hydra's proxies (mpiexec starts them with srun): they pass USR1 on to the
    ranks, which write a checkpoint and exit 75; USR2 ends a proxy, and mpiexec with 255 (no
    checkpoint exit, no requeue)."""
    out = tmp_path / "job.out"
    args = [*RUN, "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-signal", signal]
    opts = ["--nodes=2", "--ntasks-per-node=1"]
    job = cluster.submit_running("train-mpiexec.sbatch", opts, args, out, "epoch 1/")
    _signal_after_epoch_one(cluster, job, out, signal)
    got = cluster.wait_job(job)
    text = out.read_text()
    assert got == state, text
    if signal == "USR1":
        assert "xpnn: SIGUSR1: checkpoint at step" in text, text
