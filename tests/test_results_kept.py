"""No result lost without a word: ``--resume`` with nothing to resume from refuses unless told
``--resume auto``; two jobs on one metrics file; a resume with nothing left to train. Each
through the real command."""

from __future__ import annotations

import json
import time

from conftest import TINY_FLOAT64_RUN, assert_one_line_user_error, run_xpnn
from faults import Job

ARGS = [*TINY_FLOAT64_RUN, "--hidden", "16"]


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_resume_without_a_checkpoint_is_refused_unless_auto(tmp_path):
    """A mistyped ``--checkpoint-dir`` would retrain from epoch 1 and replace the metrics."""
    metrics = tmp_path / "m.jsonl"
    first = run_xpnn([*ARGS, "--checkpoint-dir", str(tmp_path / "ck"), "--metrics", str(metrics)])
    assert first.returncode == 0, first.stderr
    kept = metrics.read_bytes()
    typo = tmp_path / "kc"
    for made in (False, True):  # absent (not made by the refusal), then there and empty
        proc = run_xpnn([*ARGS, "--checkpoint-dir", str(typo), "--resume", "--metrics",
                         str(metrics)])  # fmt: skip
        assert_one_line_user_error(proc, f"--checkpoint-dir {typo}: no checkpoint to resume")
        assert metrics.read_bytes() == kept and typo.exists() == made
        typo.mkdir(exist_ok=True)
    proc = run_xpnn([*ARGS, "--checkpoint-dir", str(typo), "--resume", "auto"])
    assert proc.returncode == 0 and "starting afresh" in proc.stdout, proc.stderr
    proc = run_xpnn([*ARGS, "--checkpoint-dir", str(typo), "--resume", "sometimes"])
    assert_one_line_user_error(proc, "--resume: 'sometimes': expected auto")


def test_a_resume_with_nothing_left_to_train_adds_no_second_done(tmp_path):
    metrics = tmp_path / "m.jsonl"
    run = [*ARGS, "--checkpoint-dir", str(tmp_path / "ck"), "--metrics", str(metrics)]
    assert run_xpnn(run).returncode == 0
    once = _records(metrics)
    for _ in range(2):
        proc = run_xpnn([*run, "--resume"])
        assert proc.returncode == 0 and "nothing to train" in proc.stdout, proc.stderr
        assert _records(metrics) == once
    proc = run_xpnn([*run, "--resume", "--epochs", "3"])  # more to train: its own end
    assert proc.returncode == 0, proc.stderr
    assert [r["event"] for r in _records(metrics)] == ["epoch", "epoch", "done", "epoch", "done"]


def test_a_second_job_on_one_metrics_file_is_refused_naming_the_holder(tmp_path):
    metrics = tmp_path / "m.jsonl"
    holder = Job([*ARGS, "--epochs", "100000", "--metrics", str(metrics)], ranks=1,
                 env={"SLURM_JOB_ID": "4343"})  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (metrics.exists() and metrics.read_text()) and time.monotonic() < deadline:
            assert holder.proc.poll() is None, holder.finish(1)[1]
            time.sleep(0.05)
        written = metrics.read_text()
        proc = run_xpnn([*ARGS, "--metrics", str(metrics)], timeout=120)
        assert_one_line_user_error(proc, f"--metrics {metrics}: in use by job 4343, pid")
        assert metrics.read_text().startswith(written)  # not emptied
    finally:
        holder.kill()
        holder.finish(30)
    proc = run_xpnn([*ARGS, "--metrics", str(metrics), "--epochs", "1"])  # its holder gone
    assert proc.returncode == 0, proc.stderr
    assert not list(tmp_path.glob(".*xpnn-lock"))  # removed at the end
