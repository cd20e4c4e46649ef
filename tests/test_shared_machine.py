"""Another user on the machine, and a run's own inputs: every file xpnn writes or locks is
opened without following a symbolic link it did not make, and no run replaces a file it
reads. Each case through the real command, which refuses in one line, exit 2, with the
planted link's target untouched."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from conftest import TINY_FLOAT64_RUN, assert_one_line_user_error, run_xpnn

ONE_EPOCH = [*TINY_FLOAT64_RUN, "--hidden", "16", "--epochs", "1"]
SECRET = "another user's file\n"


def _planted(at: Path, tmp_path: Path, other_user: bool = True) -> Path:
    """A symbolic link at ``at`` to a file of the victim's; owned by another user where this
    process may give it away (root), as a planted one is."""
    victim = tmp_path / "victim.conf"
    victim.write_text(SECRET)
    at.parent.mkdir(parents=True, exist_ok=True)
    at.symlink_to(victim)
    if other_user and os.geteuid() == 0:
        os.lchown(at, 65534, 65534)
    return victim


def test_a_lock_file_planted_as_a_symlink_is_refused_and_its_target_kept(tmp_path):
    victim = _planted(tmp_path / "ck" / ".xpnn-lock", tmp_path)
    proc = run_xpnn([*ONE_EPOCH, "--checkpoint-dir", str(tmp_path / "ck")], timeout=120)
    assert_one_line_user_error(proc, ".xpnn-lock is a symbolic link")
    assert "--checkpoint-dir" in proc.stderr
    assert victim.read_text() == SECRET


def test_a_lock_file_hard_linked_to_another_file_is_refused(tmp_path):
    victim = tmp_path / "victim.conf"
    victim.write_text(SECRET)
    (tmp_path / "ck").mkdir()
    os.link(victim, tmp_path / "ck" / ".xpnn-lock")
    proc = run_xpnn([*ONE_EPOCH, "--checkpoint-dir", str(tmp_path / "ck")], timeout=120)
    assert_one_line_user_error(proc, ".xpnn-lock has other hard links")
    assert victim.read_text() == SECRET


def test_a_trace_file_planted_as_a_symlink_is_replaced_not_written_through(tmp_path):
    victim = _planted(tmp_path / "tr" / "trace-rank0.json", tmp_path)
    proc = run_xpnn([*ONE_EPOCH, "--trace", str(tmp_path / "tr")], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert victim.read_text() == SECRET
    trace = tmp_path / "tr" / "trace-rank0.json"
    assert not trace.is_symlink() and "traceEvents" in trace.read_text()


def test_a_metrics_file_planted_by_another_user_is_not_written_through(tmp_path):
    if os.geteuid() != 0:  # only root can give a link away: the user's own link is followed
        mine = tmp_path / "mine.jsonl"
        (tmp_path / "link.jsonl").symlink_to(mine)
        proc = run_xpnn([*ONE_EPOCH, "--metrics", str(tmp_path / "link.jsonl")], timeout=120)
        assert proc.returncode == 0 and '"event": "done"' in mine.read_text(), proc.stderr
        return
    victim = _planted(tmp_path / "m.jsonl", tmp_path)
    victim.write_text("")  # empty, as a fresh metrics file may be
    proc = run_xpnn([*ONE_EPOCH, "--metrics", str(tmp_path / "m.jsonl")], timeout=120)
    assert_one_line_user_error(proc, "a symbolic link of another user")
    assert victim.read_text() == ""


@pytest.mark.parametrize("flag", ["--save", "--metrics"])
def test_a_save_or_metrics_link_of_another_user_is_refused_before_training(tmp_path, flag):
    if os.geteuid() != 0:  # only root can give a link away: the user's own link is followed
        mine = tmp_path / "mine"
        (tmp_path / "link").symlink_to(mine)
        proc = run_xpnn([*ONE_EPOCH, flag, str(tmp_path / "link")], timeout=120)
        assert proc.returncode == 0 and mine.stat().st_size > 0, proc.stderr
        return
    victim = _planted(tmp_path / "out", tmp_path)
    victim.write_text("")
    proc = run_xpnn([*ONE_EPOCH, flag, str(tmp_path / "out")], timeout=120)
    assert_one_line_user_error(proc, "a symbolic link of another user")
    assert "epoch 1/1" not in proc.stdout and victim.read_text() == ""


def test_metrics_dev_null_puts_no_flight_record_in_dev(tmp_path):
    """A failing rank dumps its flight record beside the metrics file only when that is a
    file: beside ``/dev/null`` is ``/dev``."""
    before = set(Path("/dev").glob("flight-rank*.json"))
    args = [*ONE_EPOCH, "--metrics", "/dev/null"]
    proc = run_xpnn(args, timeout=120, env={"XPNN_FAIL_AT": "0:2"})
    assert proc.returncode != 0 and "injected failure" in proc.stderr, proc.stderr
    assert set(Path("/dev").glob("flight-rank*.json")) == before


def _text_corpus(path: Path) -> Path:
    path.write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    return path


@pytest.mark.parametrize("flag", ["--save", "--metrics"])
def test_save_onto_the_text_corpus_is_refused(tmp_path, flag):
    corpus = _text_corpus(tmp_path / "corpus.txt")
    kept = corpus.read_bytes()
    args = ["--dataset", "text", "--data-dir", str(corpus), "--model", "gpt", "--layers", "1",
            "--heads", "2", "--embed", "8", "--block", "6", "--steps", "1", "--threads", "1",
            "--no-progress", flag, str(corpus)]  # fmt: skip
    proc = run_xpnn(args, timeout=120)
    assert_one_line_user_error(proc, "a file this run reads (--data-dir")
    assert corpus.read_bytes() == kept


def test_save_onto_the_model_file_is_refused(tmp_path):
    model = tmp_path / "my.py"
    model.write_text(
        "from xpnn.nn import Dense, Flatten, Sequential\n\n"
        "def build(shape, classes):\n    return Sequential([Flatten(), Dense(classes)])\n"
    )
    kept = model.read_bytes()
    proc = run_xpnn([*ONE_EPOCH, "--model", f"{model}:build", "--save", str(model)], timeout=120)
    assert_one_line_user_error(proc, "a file this run reads (--model")
    assert model.read_bytes() == kept


def test_save_onto_an_idx_file_of_the_data_dir_is_refused(tmp_path):
    from test_idx import write_mnist_dir

    data = write_mnist_dir(tmp_path / "d")
    target = next(p for p in sorted(data.iterdir()) if "labels" in p.name)
    kept = target.read_bytes()
    args = ["--dataset", "mnist", "--data-dir", str(data), "--epochs", "1", "--no-progress",
            "--threads", "1", "--save", str(target)]  # fmt: skip
    proc = run_xpnn(args, timeout=120)
    assert_one_line_user_error(proc, "a file this run reads (--data-dir")
    assert target.read_bytes() == kept


def test_xpnn_writes_and_locks_only_through_the_safe_openers():
    """The audit as a test: no module of xpnn opens a file to write by another way."""
    root = Path(__file__).resolve().parents[1] / "xpnn"
    found = subprocess.run(
        ["grep", "-rnE", r"open\([^)]*['\"][wa]b?['\"]|\.write_(text|bytes)\(|O_WRONLY|O_RDWR",
         str(root), "--include=*.py"],
        capture_output=True, text=True,
    ).stdout.splitlines()  # fmt: skip
    allowed = ("xpnn/record/files.py", "xpnn/runtime/lock.py", "interrupts.py", "segments.py",
               "failure.py", "checkpoint.py", "idx.py", "plot.py", "fdopen(")  # fmt: skip
    assert [line for line in found if not any(a in line for a in allowed)] == []
