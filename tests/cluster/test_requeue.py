"""Requeue under Slurm, end to end, with the batch script docs/cluster.md quotes
(ci/slurm/requeue.sbatch): a job signalled mid-epoch, or while its ranks start, puts itself
back in the queue, resumes, and ends with the parameters and metrics of a run never stopped.
And which signals reach the ranks under ``sbatch`` + ``mpiexec``."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from .conftest import JOB_S, job_ranks, load_params, wait_until

pytestmark = pytest.mark.mpi

# 6000 samples in batches of 70: 86 steps an epoch; 6 epochs of a 512-wide layer: seconds
# on an idle machine, long enough to be signalled inside an epoch after the first
RUN = [
    "--dataset", "synthetic", "--synthetic-size", "6000", "--epochs", "6", "--batch-size", "70",
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


# 600 samples in batches of 70 (9 steps an epoch), 3 epochs of a 64-wide layer: a second
SHORT = [
    "--dataset", "synthetic", "--synthetic-size", "600", "--epochs", "3", "--batch-size", "70",
    "--dtype", "float64", "--optimizer", "adam", "--lr", "0.01", "--hidden", "64",
    "--threads", "1", "--backend", "numpy", "--no-progress",
]  # fmt: skip
# a sitecustomize that holds Python's own start-up for 3 s, before any line of xpnn runs, as a
# slow shared file system does on a cluster: room to signal the ranks inside it
SLOW_START = "import time\n\ntime.sleep(3)\n"


@pytest.fixture(scope="module")
def short_whole(cluster, tmp_path_factory):
    """SHORT never stopped, on 2 ranks under srun: (its parameters, its metrics)."""
    folder = tmp_path_factory.mktemp("whole")
    saved, metrics = folder / "p.npz", folder / "m.jsonl"
    proc = cluster.srun(
        ["-N", "1", "-n", "2", "--mpi=pmi2"],
        [*SHORT, "--save", str(saved), "--metrics", str(metrics)],
    )
    assert proc.returncode == 0, proc.stderr
    return saved, metrics


MOMENTS = ("python-starting", "xpnn-starting")


@pytest.fixture(scope="module")
def signalled_while_starting(cluster, tmp_path_factory) -> dict[str, dict]:
    """A job of SHORT for each moment, side by side, each sent ``scancel -s USR1`` at its
    moment and waited for: {moment: its folder, final state, restarts, output, and whether
    xpnn's handler was in when the signal went}."""
    jobs = {}
    for moment in MOMENTS:
        folder = tmp_path_factory.mktemp(moment)
        args = [str(folder / "ck"), *SHORT]
        args += ["--save", str(folder / "p.npz"), "--metrics", str(folder / "m.jsonl")]
        env = {"XPNN_HANDLER_MARK": str(folder / "handler")}  # handler.RANK: it is in
        if moment == "python-starting":
            (folder / "site").mkdir()
            (folder / "site" / "sitecustomize.py").write_text(SLOW_START)
            path = [str(folder / "site"), os.getenv("PYTHONPATH")]
            env["PYTHONPATH"] = os.pathsep.join(filter(None, path))
        job = cluster.submit("requeue.sbatch", [], args, folder / "job.out", env=env)
        jobs[moment] = {"folder": folder, "job": job}

    def marks(moment: str) -> list[bool]:
        return [(jobs[moment]["folder"] / f"handler.{rank}").exists() for rank in (0, 1)]

    def due(moment: str) -> bool:
        if moment == "python-starting":  # its ranks' processes are there, inside Python
            return len(job_ranks(jobs[moment]["job"])) == 2
        return all(marks(moment))

    def signal_those_due() -> bool:
        for moment, job in jobs.items():
            if "handler_in" not in job and due(moment):
                proc = cluster.run(["scancel", "-s", "USR1", job["job"]])
                assert proc.returncode == 0, proc.stderr
                job["handler_in"] = any(marks(moment))
        return all("handler_in" in job for job in jobs.values())

    wait_until(signal_those_due, JOB_S, "each job's moment")
    for job in jobs.values():
        job["state"] = cluster.wait_job(job["job"])
        job["restarts"] = cluster.job(job["job"])["Restarts"]
        job["text"] = (job["folder"] / "job.out").read_text()
    return jobs


@pytest.mark.parametrize("moment", MOMENTS)
def test_a_job_signalled_while_starting_requeues_and_ends_as_if_never_stopped(
    signalled_while_starting, short_whole, moment
):
    """``scancel -s USR1`` while the ranks start. Inside Python's own start-up, before xpnn's
    first line, USR1's default action ends the ranks (srun exits 138) and the script requeues
    the job all the same; from xpnn's first line on, the signal is noted, and the checkpoint
    written at the first step's end (exit 75). Either way the job ends as if never stopped."""
    job = signalled_while_starting[moment]
    text = job["text"]
    assert job["state"] == "COMPLETED 0:0", text
    assert job["restarts"] == "1", text
    if moment == "python-starting":
        assert not job["handler_in"]  # still inside Python's start-up
        assert "tasks 0-1: User defined signal 1" in text, text
        assert "checkpoint at step" not in text, text
        assert text.count("resume: no checkpoint in") == 1, text  # the first run said nothing
    else:
        assert "xpnn: SIGUSR1: checkpoint at step 1 (1 of epoch 1's 9 steps) written" in text
        assert re.search(
            r"resume: .*checkpoint-epoch0000-step00000001\.npz \(epoch 0, step 1\)", text
        )
    folder = job["folder"]
    _assert_as_if_never_stopped(folder / "p.npz", folder / "m.jsonl", *short_whole)


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
