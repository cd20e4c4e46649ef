"""Every reader reads at most what a well-formed input holds: a device (``/dev/zero`` never
ends), a named pipe (never answers) or a file larger than memory is refused in one line, and
a preset network larger than memory is refused before it is built. Through the real commands
(each bounded by a timeout: a hang fails the test), and the limits in the process."""

from __future__ import annotations

import os

import pytest
from conftest import TINY_FLOAT64_RUN, assert_one_line_user_error, run_xpnn

from xpnn.data import text
from xpnn.errors import UserError
from xpnn.runtime import threads as memory

GPT = ["--model", "gpt", "--dataset", "text", "--layers", "1", "--heads", "2", "--embed", "8",
       "--block", "6", "--steps", "1", "--threads", "1", "--no-progress"]  # fmt: skip


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


def test_text_from_a_device_or_a_pipe_is_refused(fifo):
    for source, kind in (("/dev/zero", "a character device"), (str(fifo), "a named pipe")):
        proc = run_xpnn([*GPT, "--data-dir", source], timeout=60)
        assert_one_line_user_error(proc, f"--data-dir {source}: {kind}, not a file")


def test_text_larger_than_memory_is_refused_before_it_is_read(tmp_path, monkeypatch):
    corpus = tmp_path / "big.txt"
    corpus.write_text("x" * 4096)
    monkeypatch.setattr(text, "memory_bytes", lambda: 4096 * text.TEXT_BYTES_PER_CHAR - 1)
    with pytest.raises(UserError, match="4,096 bytes of text need more than this machine"):
        text.read_text(corpus)
    monkeypatch.setattr(text, "memory_bytes", lambda: 4096 * text.TEXT_BYTES_PER_CHAR)
    assert text.read_text(corpus) == "x" * 4096


def test_generate_and_resume_refuse_a_checkpoint_that_is_no_file(tmp_path, fifo):
    proc = run_xpnn(["generate", "/dev/zero"], timeout=60)
    assert_one_line_user_error(proc, "/dev/zero: not an xpnn checkpoint (not a regular file)")
    ck = tmp_path / "ck"
    ck.mkdir()
    os.rename(fifo, ck / "checkpoint-epoch0001.npz")
    proc = run_xpnn(["generate", str(ck)], timeout=60)
    assert_one_line_user_error(proc, "checkpoint-epoch0001.npz: not an xpnn checkpoint")
    (ck / "checkpoint-epoch0001.npz").unlink()
    (ck / "checkpoint-epoch0001.npz").symlink_to("/dev/zero")
    proc = run_xpnn([*TINY_FLOAT64_RUN, "--checkpoint-dir", str(ck), "--resume"], timeout=60)
    assert_one_line_user_error(proc, "checkpoint-epoch0001.npz: not an xpnn checkpoint")


def test_a_network_larger_than_memory_is_refused_before_it_is_built():
    """784 x 3,000,000 weights: tens of GiB with gradients and Adam's two states."""
    proc = run_xpnn([*TINY_FLOAT64_RUN, "--hidden", "3000000"], timeout=60)
    said = "--hidden 3000000: the network does not fit in memory: its 2,385,000,010 parameters"
    assert_one_line_user_error(proc, said)


def test_the_network_estimate_counts_parameters_gradients_and_state(monkeypatch):
    params = memory.preset_parameters("mlp", (1, 28, 28), 10, (16,), {})
    assert params == 784 * 16 + 16 + 16 * 10 + 10
    need = params * 8 * (2 + 2)  # float64, Adam
    monkeypatch.setattr("xpnn.data.files.memory_bytes", lambda: need)
    memory.check_network_fits("`hidden` 16", params, 8, 2)
    monkeypatch.setattr("xpnn.data.files.memory_bytes", lambda: need - 1)
    said = "`hidden` 16: the network does not fit in memory: its 12,730 parameters"
    with pytest.raises(UserError, match=said):
        memory.check_network_fits("`hidden` 16", params, 8, 2)
    assert memory.preset_parameters("my.py:build", (3,), 2, (), {}) is None
