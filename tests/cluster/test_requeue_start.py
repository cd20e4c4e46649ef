"""Requeue under Slurm when the signal comes while the job's ranks start, with the batch script
docs/cluster.md quotes (ci/slurm/requeue.sbatch): inside Python's own start-up, and from xpnn's
first line on. Either way the job is requeued, resumes, and ends as a run never stopped."""

from __future__ import annotations

import os
import re

import pytest

from .conftest import JOB_S, job_ranks, wait_until
from .test_requeue import _assert_as_if_never_stopped

pytestmark = pytest.mark.mpi

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
