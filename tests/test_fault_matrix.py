"""The fault matrix: every fault, at every moment, ends a real ``mpiexec -n 2`` job in bounded
time with a meaningful exit code, one line, and nothing left in /tmp or /dev/shm.

Faults: an exception in a rank, ``kill -9`` and SIGTERM of a rank, SIGTERM and SIGINT of
``mpiexec``, SIGSTOP of a rank with ``--stall-abort``. Moments: start-up (the ranks import
and start MPI), mid-training (after epoch 2), and while rank 0 writes a checkpoint (the write
held open by ``XPNN_SAVE_FAULT=sleep:S``). Every checkpoint left behind must load.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from conftest import TINY_FLOAT64_RUN, run_xpnn
from faults import Job, left_behind, maps_numpy, mpi_started, record, snapshot, wait_for_write

pytestmark = pytest.mark.mpi

ARGS = [*TINY_FLOAT64_RUN, "--hidden", "16", "--epochs", "100000"]
STALL = ["--stall-warn", "1", "--stall-abort", "2"]  # for the stopped rank only: a rank waits
# legitimately while rank 0 writes a checkpoint, which the other cases hold open for 30 s
BOUND_S = 15.0  # from the fault to the job's end (stop grace 10 s, stall abort 2 s + defer)

# fault -> (exit code, what stderr says); kill -9 is hydra's to report (it names the signal)
EXPECTED = {
    "exception": (1, "injected failure at step"),
    "kill-9-rank": (9, None),
    "sigterm-rank": (143, "rank 1: terminated (SIGTERM)"),
    "sigterm-mpiexec": (143, "xpnn: terminated (SIGTERM)"),
    "sigint-mpiexec": (130, "xpnn: interrupted"),
    "sigstop-rank": (124, "xpnn: stalled: rank 0 waited 2 s for rank 1"),
}
AT_CHECKPOINT = {  # a failing write is the disk's fault: a user error naming the directory
    "exception": (2, "No space left on device"),
}
MOMENTS = ("start-up", "mid-training", "checkpoint")


def _hit(job: Job, fault: str, moment: str) -> None:
    if fault == "exception":
        return  # injected through the environment
    ranks = job.ranks(2)
    if fault == "sigstop-rank" and moment == "start-up":
        while not mpi_started(job.proc.pid):  # before, the others wait inside MPI_Init
            time.sleep(0.005)
    elif moment == "start-up":
        while not all(maps_numpy(pid) for pid in ranks.values()):
            time.sleep(0.002)
    target = job.proc.pid if fault.endswith("mpiexec") else ranks[1]
    signum = {
        "kill-9-rank": signal.SIGKILL,
        "sigterm-rank": signal.SIGTERM,
        "sigterm-mpiexec": signal.SIGTERM,
        "sigint-mpiexec": signal.SIGINT,
        "sigstop-rank": signal.SIGSTOP,
    }[fault]
    os.kill(target, signum)


def _environment(fault: str, moment: str) -> dict:
    env = {}
    if moment == "checkpoint":
        env["XPNN_SAVE_FAULT"] = {"exception": "enospc", "sigstop-rank": "sleep:3"}.get(
            fault, "sleep:30"
        )
    elif fault == "exception":
        env["XPNN_FAIL_AT"] = "1:0" if moment == "start-up" else "1:12"
    return env


@pytest.mark.parametrize("moment", MOMENTS)
@pytest.mark.parametrize("fault", list(EXPECTED))
def test_every_fault_ends_the_job_cleanly(tmp_path, fault, moment):
    ck = tmp_path / "ck"
    before = snapshot()
    args = [*ARGS, "--checkpoint-dir", str(ck), *(STALL if fault == "sigstop-rank" else [])]
    job = Job(args, env=_environment(fault, moment))
    try:
        if moment == "mid-training":
            job.wait_for_line("epoch 2/")
        elif moment == "checkpoint" and fault != "exception":
            wait_for_write(job, ck)  # rank 0 is inside the write
        _hit(job, fault, moment)
        code, err, seconds = job.finish(BOUND_S + 30)
    finally:
        job.kill()
    want_code, said = (AT_CHECKPOINT if moment == "checkpoint" else {}).get(fault, EXPECTED[fault])
    lines = [line for line in err.splitlines() if line.strip()]
    record(
        test="matrix",
        fault=fault,
        moment=moment,
        exit=code,
        seconds=round(seconds, 2),
        stderr=lines,
    )
    assert code is not None, f"still running {BOUND_S + 30} s after the fault: {err}"
    assert seconds < BOUND_S, (seconds, err)
    assert code == want_code, err
    assert "Traceback" not in err, err
    if said:
        lines = [line for line in err.splitlines() if said in line]
        assert len(lines) == 1, err
    # whatever was being written is whole or gone; a writer killed by a signal that cannot
    # be caught leaves its temporary file, which the next run in the directory removes
    for path in ck.glob("checkpoint-epoch*.npz"):
        with np.load(path, allow_pickle=False) as data:
            assert "meta.epoch" in data.files
    if list(ck.glob("*.tmp")):  # rank 0 was killed while it wrote (SIGKILL: kill -9, or
        # hydra ending the ranks that MPI_Abort left): the next run removes the file
        proc = run_xpnn(
            [
                *TINY_FLOAT64_RUN,
                "--hidden",
                "16",
                "--checkpoint-dir",
                str(ck),
                "--resume",
                "--epochs",
                "1",
            ]
        )
        assert proc.returncode == 0, proc.stderr
        assert not list(ck.glob("*.tmp"))
    assert left_behind(before) == []
