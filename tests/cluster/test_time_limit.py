"""Slurm's own clock, as docs/cluster.md says: a job of ci/slurm/requeue.sbatch gets the
signal of its ``--signal=USR1@60`` from Slurm as its end nears, writes a checkpoint, exits 75,
is requeued and resumes from it; a job that reaches its time limit gets SIGTERM on every rank,
whose ranks stop together (exit 143), every checkpoint left whole, and is not requeued.

Slurm keeps time limits in whole minutes and looks at its jobs' clocks every 30 s. So both jobs
are submitted with 10 minutes, and once they train their end is moved near (``scontrol update
EndTime``, as an administrator may): the requeue job's to 60 s from now, within its
``--signal``, the other's to now. One look of Slurm's, at most 30 s later, acts on both."""

from __future__ import annotations

import re
import time

import pytest

from xpnn.train.checkpoint import CHECKPOINT_NAME, read_npz

from .conftest import JOB_S, job_ranks, wait_until

pytestmark = pytest.mark.mpi

# 3000 samples in batches of 70 (43 steps an epoch) of a 128-wide layer, without end: a
# checkpoint every fraction of a second, until Slurm says stop
ENDLESS = [
    "--dataset", "synthetic", "--synthetic-size", "3000", "--epochs", "100000",
    "--batch-size", "70", "--dtype", "float64", "--optimizer", "adam", "--lr", "0.01",
    "--hidden", "128", "--threads", "1", "--backend", "numpy", "--no-progress",
]  # fmt: skip
LOOK_S = 30  # Slurm's look at its jobs' time limits (PERIODIC_TIMEOUT), and so at --signal's


def _text(path) -> str:
    return path.read_text() if path.exists() else ""


def _move_end(cluster, job: str, end: str) -> None:
    """``scontrol update EndTime=END``, asked again while slurmctld refuses it ("Invalid time
    specified"): it refuses an end already past when it handles the request, and ``now``, read
    by scontrol in one second, is past if a loaded controller handles it in the next."""
    for _ in range(20):
        proc = cluster.run(["scontrol", "update", f"JobId={job}", f"EndTime={end}"])
        if proc.returncode == 0:
            return
        time.sleep(0.25)
    pytest.fail(f"job {job}: EndTime={end} refused: {proc.stderr}")


@pytest.fixture(scope="module")
def near_their_end(cluster, tmp_path_factory):
    """Both jobs run to where Slurm's clock leaves them: (the folder, the requeue job's output,
    the limited job's output, the limited job's id, the requeue job's restarts, the seconds
    from moving their ends to the time limit's kill). Their jobs are cancelled after."""
    folder = tmp_path_factory.mktemp("limits")
    signalled, limited = folder / "signalled.out", folder / "limited.out"
    ten = ["--time=10"]
    try:
        a = cluster.submit("requeue.sbatch", ten, [str(folder / "ck-a"), *ENDLESS], signalled)
        b = cluster.submit(
            "train-srun.sbatch",
            [*ten, "--nodes=1", "--ntasks-per-node=2"],
            [*ENDLESS, "--checkpoint-dir", str(folder / "ck-b")],
            limited,
        )
        for out in (signalled, limited):
            wait_until(lambda out=out: "epoch 2/" in _text(out), JOB_S, f"{out.name}: epoch 2")
        moved = time.monotonic()
        for job, end in ((a, "now+60"), (b, "now")):
            _move_end(cluster, job, end)
        cluster.wait_job(b, LOOK_S + 30)
        killed_s = time.monotonic() - moved
        # the requeued job trains again: an epoch line after its resume from a checkpoint
        resumed = re.compile(r"resume: \S+\.npz [^\n]*\n(?:[^\n]*\n)*?epoch \d+/")
        wait_until(lambda: resumed.search(_text(signalled)), LOOK_S + JOB_S, "the resumed training")
        restarts = cluster.job(a)["Restarts"]
    finally:
        cluster.cancel_all()  # the requeue job trains on without end
    return folder, signalled, limited, b, restarts, killed_s


def test_a_signal_at_T_before_the_limit_checkpoints_requeues_and_resumes(near_their_end):
    _, signalled, *_, restarts, _ = near_their_end
    text = _text(signalled)
    assert restarts == "1", text
    said = re.search(r"xpnn: SIGUSR1: checkpoint (?:at step (\d+) |of epoch (\d+) )", text)
    assert said, text
    name = f"-step{int(said[1]):08d}.npz" if said[1] else f"-epoch{int(said[2]):04d}.npz"
    assert re.search(rf"resume: \S+{re.escape(name)} \(epoch \d+", text), text  # from it
    assert "DUE TO TIME LIMIT" not in text, text


def test_a_time_limit_stops_every_rank_and_keeps_the_checkpoints_whole(near_their_end):
    folder, _, limited, job, _, killed_s = near_their_end
    text = _text(limited)
    assert re.search(rf"JOB {job} ON n\d CANCELLED AT \S+ DUE TO TIME LIMIT", text), text
    assert killed_s < LOOK_S + 10, text  # Slurm's next look, not a later one
    assert "xpnn: terminated (SIGTERM)" in text, text
    assert re.search(r"tasks? [0-9-]+: Exited with exit code 143", text), text
    assert not job_ranks(job)  # the ranks stopped together
    files = sorted((folder / "ck-b").iterdir())
    checkpoints = [f for f in files if CHECKPOINT_NAME.fullmatch(f.name)]
    assert checkpoints and len(checkpoints) == len([f for f in files if f.suffix == ".npz"])
    assert not [f for f in files if f.name.endswith(".tmp")], files  # none half written
    for path in checkpoints:
        assert read_npz(path), path  # whole: every array reads
