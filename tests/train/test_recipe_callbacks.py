"""Callbacks when training by steps: one progress bar over the run, eval records written."""

import io
import json
from types import SimpleNamespace

from xpnn.train.callbacks import MetricsFile, ProgressBar


def test_the_progress_bar_counts_a_run_by_steps(monkeypatch):
    shown = io.StringIO()
    monkeypatch.setattr("sys.stderr", shown)
    trainer = SimpleNamespace(cfg=SimpleNamespace(steps=3), steps_per_epoch=2, is_root=True)
    bar = ProgressBar()
    for step in range(3):
        bar.on_step_end(trainer, step)
    assert bar.bar.n == 3 and bar.bar.total == 3
    bar.on_train_end(trainer, {"event": "done"})
    assert bar.bar is None


def test_eval_records_go_to_the_metrics_file(tmp_path):
    path = tmp_path / "m.jsonl"
    fresh = SimpleNamespace(step_count=0)  # no step trained: a fresh run, a fresh file
    trainer = SimpleNamespace(is_root=True, start_epoch=0, optimizer=fresh)
    metrics = MetricsFile(str(path))
    metrics.on_train_begin(trainer)
    metrics.on_eval(trainer, {"event": "eval", "step": 4, "test_loss": float("nan")})
    assert json.loads(path.read_text()) == {"event": "eval", "step": 4, "test_loss": None}
