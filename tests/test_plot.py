"""``python -m xpnn plot``: training curves from metrics files, one or several runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT


def metrics_file(path, world_size, epochs=3):
    lines = [
        {"event": "epoch", "epoch": e, "train_loss": 1 / e, "test_loss": 1.2 / e,
         "train_acc": 1 - 0.5 / e, "test_acc": 1 - 0.6 / e, "seconds": 1.0,
         "samples_per_s": 1000.0 * e, "world_size": world_size, "backend": "numpy"}
        for e in range(1, epochs + 1)
    ]  # fmt: skip
    lines.append({"event": "done", "epochs": epochs, "test_acc": 0.8})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def plot(*args, env=None):
    cmd = [sys.executable, "-m", "xpnn", "plot", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)


def test_two_runs_side_by_side_make_one_png(tmp_path):
    import matplotlib.image

    a, b = metrics_file(tmp_path / "a.jsonl", 1), metrics_file(tmp_path / "b.jsonl", 2)
    out = tmp_path / "curves.png"
    proc = plot(a, b, "-o", out)
    assert proc.returncode == 0, proc.stderr
    image = matplotlib.image.imread(out)  # a valid PNG that matplotlib reads back
    assert image.shape[1] > 2 * image.shape[0]  # three panels side by side


def test_an_output_that_is_a_link_is_replaced_not_written_through(tmp_path):
    a = metrics_file(tmp_path / "a.jsonl", 1)
    target = tmp_path / "elsewhere.png"
    target.write_bytes(b"not to be touched")
    out = tmp_path / "curves.png"
    out.symlink_to(target)
    proc = plot(a, "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert target.read_bytes() == b"not to be touched"
    assert not out.is_symlink() and out.read_bytes().startswith(b"\x89PNG")


def test_a_file_without_epochs_is_one_line_exit_2(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"event": "done"}\n')
    proc = plot(bad, "-o", tmp_path / "x.png")
    assert proc.returncode == 2
    assert (
        proc.stderr.strip() == f"xpnn plot: {bad}: no epoch records (is it an xpnn --metrics file?)"
    )
    assert not (tmp_path / "x.png").exists()


def test_without_matplotlib_it_says_how_to_install(tmp_path):
    fake = tmp_path / "no-mpl" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('matplotlib is not installed')\n")
    env = {**os.environ, "PYTHONPATH": f"{fake.parent}{os.pathsep}{ROOT}"}
    proc = plot(metrics_file(tmp_path / "a.jsonl", 1), "-o", tmp_path / "x.png", env=env)
    assert proc.returncode == 2
    assert "pip install" in proc.stderr and "Traceback" not in proc.stderr


def test_a_run_by_steps_plots_its_eval_records(tmp_path):
    from xpnn.record.plot import read_epochs

    path = tmp_path / "steps.jsonl"
    lines = [{"event": "eval", "step": s, "epoch": s / 5, "train_loss": 1 / s} for s in (4, 8)]
    path.write_text("".join(json.dumps(x) + "\n" for x in [*lines, {"event": "done"}]))
    assert [r["epoch"] for r in read_epochs(path)] == [0.8, 1.6]
    proc = plot(path, "-o", tmp_path / "steps.png")
    assert proc.returncode == 0, proc.stderr


def _drawn(tmp_path, monkeypatch, records: list[dict]):
    """The figure ``xpnn plot`` draws of one metrics file of ``records``, kept to be read."""
    import matplotlib.pyplot as plt

    from xpnn.record.plot import draw

    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in records))
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    draw([path], tmp_path / "m.png")
    (fig,) = figures
    return fig


def test_a_steps_run_of_a_text_model_reads_as_its_docs_speak(tmp_path, monkeypatch):
    """Steps on the x axis, tokens/s, "validation", and a unit on every axis."""
    recs = [{"event": "eval", "step": s, "epoch": s / 500, "train_loss": 3 - s / 100,
             "test_loss": 3.1 - s / 100, "val_loss": 3.1 - s / 100, "test_acc": 0.2,
             "train_acc": 0.2, "samples_per_s": 130.0, "tokens_per_s": 16000.0}
            for s in (30, 60, 90)]  # fmt: skip
    fig = _drawn(tmp_path, monkeypatch, recs)
    loss, acc, rate = fig.axes
    assert {ax.get_xlabel() for ax in fig.axes} == {"step (optimizer steps)"}
    assert list(loss.get_lines()[0].get_xdata()) == [30, 60, 90]
    assert loss.get_ylabel() == "loss (nats per character)"
    assert any("validation loss" in t.get_text() for t in loss.get_legend().get_texts())
    assert not any("test" in t.get_text() for t in loss.get_legend().get_texts())
    assert (
        rate.get_ylabel() == "tokens / s" and list(rate.get_lines()[0].get_ydata()) == [16000.0] * 3
    )
    assert all(ax.get_ylabel() for ax in fig.axes)


def test_a_file_with_only_train_loss_draws_without_a_warning(tmp_path, monkeypatch, recwarn):
    fig = _drawn(tmp_path, monkeypatch, [{"event": "epoch", "epoch": e, "train_loss": 1 / e}
                                         for e in (1, 2)])  # fmt: skip
    assert not [w for w in recwarn.list if "artists" in str(w.message)]
    assert fig.axes[0].get_xlabel() == "epoch" and fig.axes[2].get_ylabel() == "samples / s"
    assert any("no accuracy" in t.get_text() for t in fig.axes[1].texts)


@pytest.mark.parametrize("path", ["/dev/zero", "/dev/null", "fifo"])
def test_a_device_or_a_fifo_is_refused_in_one_line(tmp_path, path):
    if path == "fifo":
        path = tmp_path / "fifo"
        os.mkfifo(path)
    proc = plot(path, "-o", tmp_path / "x.png")
    assert proc.returncode == 2, proc.stderr
    assert "not a regular file" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
