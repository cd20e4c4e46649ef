"""Text data: the character vocabulary, the 90/10 split, seeded windows, tiny Shakespeare's
hash-checked download (from a local server) and the one-line errors."""

import hashlib
import json

import numpy as np
import pytest
from conftest import assert_one_line_user_error, run_xpnn
from test_download import Server

from xpnn.data import load_dataset, text
from xpnn.errors import UserError

TEXT = "the quick brown fox jumps over the lazy dog\n" * 12


def test_windows_vocabulary_and_split(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text(TEXT)
    data = load_dataset("text", path, block=5, seed=3)
    vocab = data.vocab
    assert vocab.chars == "".join(sorted(set(TEXT))) and data.num_classes == len(vocab.chars)
    cut = int(len(TEXT) * 0.9)
    train, held = TEXT[:cut], TEXT[cut:]
    assert data.n_train == text.TEXT_WINDOWS and data.input_shape == (5,)
    stream = data.windows.stream
    spans = data.windows.spans(seed=3, step=7, samples=np.arange(50))
    for x, y in zip(stream[spans], stream[spans + 1], strict=True):
        window = vocab.decode(x) + vocab.decode(y[-1:])
        assert window in train and vocab.decode(y) == window[1:]
    joined = "".join(vocab.decode(row) for row in data.x_test)
    assert held.startswith(joined) and len(joined) == (len(held) - 1) // 5 * 5
    assert (data.y_test[:, :-1] == data.x_test[:, 1:]).all()


def test_windows_are_fresh_each_step_and_fixed_by_seed_step_and_sample():
    windows = text.TextWindows(np.arange(10_000, dtype=np.int32), block=8, per_epoch=1000)
    samples = np.array([5, 900, 17, 3])
    first = windows.starts(0, 4, samples)
    np.testing.assert_array_equal(first, windows.starts(0, 4, samples))
    # a sample's start does not depend on which other samples a rank draws with it
    np.testing.assert_array_equal(first[1:3], windows.starts(0, 4, samples[1:3]))
    assert not np.array_equal(first, windows.starts(0, 5, samples))  # the next step: fresh
    assert not np.array_equal(first, windows.starts(1, 4, samples))  # another seed
    everything = windows.starts(0, 4, np.arange(1000))
    assert everything.min() >= 0 and everything.max() < 10_000 - 8
    assert len(np.unique(everything)) > 900  # drawn across the whole text


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\xff\xfe not utf-8", "not UTF-8 text"),
        (b"short", "too few for windows of `block` 5"),
    ],
)
def test_bad_text_is_a_user_error(tmp_path, content, message):
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    with pytest.raises(UserError, match=message):
        load_dataset("text", path, block=5)
    with pytest.raises(UserError, match="a directory"):
        load_dataset("text", tmp_path, block=5)
    with pytest.raises(UserError, match="needs `data_dir`"):
        load_dataset("text", None, block=5)


def test_tinyshakespeare_is_downloaded_checked_and_cached(tmp_path, monkeypatch):
    payload = TEXT.encode()
    monkeypatch.setattr(text, "SHAKESPEARE_SHA256", hashlib.sha256(payload).hexdigest())
    monkeypatch.setenv("XPNN_DATA_HOME", str(tmp_path / "cache"))
    root = tmp_path / "www"
    root.mkdir()
    (root / "input.txt").write_bytes(payload)
    server = Server(root)
    try:
        monkeypatch.setenv(text.SHAKESPEARE_MIRRORS_ENV, server.url)
        data = load_dataset("tinyshakespeare", block=4)
        assert (tmp_path / "cache" / "tinyshakespeare" / "input.txt").read_bytes() == payload
        assert load_dataset("tinyshakespeare", block=4, download=False).num_classes == 28
        assert len(server.requests) == 1  # the second load read the cache
    finally:
        server.close()
    assert data.vocab.chars == "".join(sorted(set(TEXT)))
    (root / "input.txt").write_bytes(payload.upper())  # a directory of another file: refused
    with pytest.raises(UserError, match="not tiny Shakespeare's input.txt"):
        load_dataset("tinyshakespeare", root, block=4)


def test_a_wrong_download_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("XPNN_DATA_HOME", str(tmp_path / "cache"))
    root = tmp_path / "www"
    root.mkdir()
    (root / "input.txt").write_text(TEXT)  # not the real file: its hash differs
    server = Server(root)
    try:
        monkeypatch.setenv(text.SHAKESPEARE_MIRRORS_ENV, server.url)
        with pytest.raises(UserError, match="could not download input.txt") as caught:
            load_dataset("tinyshakespeare", block=4)
        assert str(caught.value).endswith("; offline, pass `data_dir` holding input.txt")
    finally:
        server.close()
    assert not (tmp_path / "cache" / "tinyshakespeare" / "input.txt").exists()


def test_gpt_run_reports_text_metrics_and_generates(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text(TEXT)
    metrics, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    args = ["--model", "gpt", "--dataset", "text", "--data-dir", str(path), "--layers", "1"]
    args += ["--embed", "8", "--heads", "2", "--block", "8", "--batch-size", "2000"]
    args += ["--epochs", "2", "--lr", "0.01", "--no-progress", "--threads", "1"]
    proc = run_xpnn([*args, "--metrics", str(metrics), "--checkpoint-dir", str(ck)])
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    epoch, done = records[-2], records[-1]
    for rec in (epoch, done):
        assert rec["val_loss"] == rec["test_loss"]
        assert rec["perplexity"] == pytest.approx(np.exp(rec["val_loss"]))
        assert rec["next_char_acc"] == rec["test_acc"] and rec["tokens_per_s"] > 0
    assert epoch["tokens_per_s"] == pytest.approx(epoch["samples_per_s"] * 8)
    assert records[-2]["val_loss"] < records[-3]["val_loss"]  # it learns
    gen = ["generate", str(ck), "--chars", "40", "--seed", "1", "--temperature", "0.5"]
    first, second = run_xpnn(gen), run_xpnn([*gen, "--backend", "numba"])
    assert first.returncode == 0, first.stderr
    written = first.stdout.rstrip("\n")
    assert len(written) >= 39 and set(written) <= set(TEXT)
    assert second.stdout == first.stdout  # the same draws on another backend
    proc = run_xpnn(["generate", str(path)])
    assert_one_line_user_error(proc, "not an xpnn checkpoint")
    proc = run_xpnn([*gen, "--prompt", "XYZ"])
    assert_one_line_user_error(proc, "characters the model never saw")


def test_a_step_draws_its_own_windows_not_the_epochs():
    """The starts of a step's samples cost the same whatever an epoch counts: 10**15 samples an
    epoch (drawing them all would take 8 PB) give 4 starts at once."""
    windows = text.TextWindows(np.arange(10_000, dtype=np.int32), block=8, per_epoch=10**15)
    got = windows.starts(0, 4, np.array([0, 10**15 - 1, 3, 3]))
    assert got.shape == (4,) and got.dtype == np.int64 and got[2] == got[3]
    assert got.min() >= 0 and got.max() < 10_000 - 8
