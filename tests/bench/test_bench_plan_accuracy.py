"""The planner's accuracy benchmark: the measured step read from a run's records, and the
table's error, summary and pick computed from predicted and measured steps."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import pytest

from bench.benchmarks import plan_accuracy


def test_the_measured_step_is_the_batch_over_each_steady_epochs_rate():
    metrics = [
        {"event": "epoch", "samples_per_s": 10.0},  # the first epoch compiles: left out
        {"event": "epoch", "samples_per_s": 1000.0},
        {"event": "epoch", "samples_per_s": 2000.0},
        {"event": "epoch", "samples_per_s": 4000.0},
        {"event": "done"},
    ]
    assert plan_accuracy.measured_step(metrics, 100) == pytest.approx(100 / 2000)


def _record(model, ranks, predicted, measured):  # noqa: ANN001, ANN202
    samples = measured if isinstance(measured, list) else [measured]
    return {
        "config": {"model": model, "ranks": ranks, "layout": ["--threads", "1"],
                   "predicted_step_s": predicted},
        "metrics": {"step_s": {"median": sorted(samples)[len(samples) // 2],
                               "min": min(samples), "max": max(samples), "samples": samples}},
    }  # fmt: skip


def test_the_table_gives_each_error_the_median_the_worst_and_the_picks_gap():
    records = [
        _record("mlp", 1, 0.010, 0.008),  # +25%
        _record("mlp", 2, 0.005, 0.010),  # -50%, predicted best, measured 2x the best
        _record("mlp", 4, 0.020, [0.004, 0.005, 0.006]),  # +300%
    ]
    assert plan_accuracy.errors(records) == pytest.approx([0.25, -0.5, 3.0])
    text = plan_accuracy.table(records)
    assert "+25%" in text and "-50%" in text and "+300%" in text
    assert "median |error| 50%, worst 300%, 3 layouts" in text
    assert "mlp: the predicted best is 100% behind the measured best" in text
    assert "plan's picks (any layout of a model) within 10% of the measured best: 0 of 1" in text
    assert plan_accuracy.pick_gaps(records, "ranks") == {}  # one layout a rank count


RECORDED = Path(__file__).resolve().parents[2] / "bench" / "recorded"
RECORD = RECORDED / "plan-accuracy-2cpu-2026-11-29.jsonl"
CALIBRATION = RECORDED / "calibration-plan-accuracy-2cpu-2026-11-29.json"


def _recorded() -> list[dict]:
    return [json.loads(line) for line in RECORD.read_text().splitlines() if line.strip()]


def test_a_recorded_command_gives_its_training_flags_and_layout():
    config = {
        "command": "mpiexec -n 2 python -m xpnn --model gpt --data-dir /x/README.md --threads 1 "
        "--parallel pipeline --microbatches 4 --pipeline-schedule 1f1b --metrics m.jsonl",
        "layout": ["--threads", "1", "--parallel", "pipeline", "--microbatches", "4",
                   "--pipeline-schedule", "1f1b"],
        "ranks": 2,
    }  # fmt: skip
    assert plan_accuracy.run_flags(config["command"]) == [
        "--model", "gpt", "--threads", "1", "--parallel", "pipeline", "--microbatches", "4",
        "--pipeline-schedule", "1f1b",
    ]  # fmt: skip
    assert plan_accuracy.layout_of(config) == (2, 1, "pipeline", 1, 4, "1f1b")


def test_the_record_predicted_again_from_its_calibration_meets_the_targets():
    """Offline: the recorded steps against this planner's predictions from the calibration
    the record was taken with (its own predictions missed the worst case by 68 %)."""
    records = _recorded()
    again = plan_accuracy.reread(records, argparse.Namespace(calibration=CALIBRATION))
    errors = [abs(e) for e in plan_accuracy.errors(again)]
    assert statistics.median(errors) <= 0.15
    assert max(errors) <= 0.35
    was = [abs(e) for e in plan_accuracy.errors(records)]
    assert max(was) > 0.6  # the record's own predictions, kept beside
    assert [r["config"]["recorded_predicted_step_s"] for r in again] == [
        r["config"]["predicted_step_s"] for r in records
    ]
    text = plan_accuracy.table(again)
    assert "predicted again from the calibration given (the record names no calibration)" in text
    named = [{**r, "config": {**r["config"], "calibration": {"digest": "0" * 16}}} for r in records]
    again = plan_accuracy.reread(named, argparse.Namespace(calibration=CALIBRATION))
    assert "(not the one the record used)" in plan_accuracy.table(again)
    digest = again[0]["config"]["predicted_from"]
    named = [{**r, "config": {**r["config"], "calibration": {"digest": digest}}} for r in records]
    again = plan_accuracy.reread(named, argparse.Namespace(calibration=CALIBRATION))
    assert "(the record's own)" in plan_accuracy.table(again)
    # auto's choice among one rank count's layouts: within 10 % of the best in 4 of 5 at least
    gaps = plan_accuracy.pick_gaps(again, "ranks")
    assert set(gaps) == {(m, r) for m in ("mlp", "cnn", "gpt") for r in (1, 2)}
    assert sum(gap <= plan_accuracy.PICK_WITHIN for gap in gaps.values()) >= 0.8 * len(gaps)


def test_a_run_names_the_calibration_it_predicted_from(tmp_path, monkeypatch):
    from xpnn.planner.machine import Machine, cache_path, load, machine_key, save
    from xpnn.runtime.threads import node_cores

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    key = machine_key(node_cores())
    save(Machine(key, gemm={"float32 1 8 8 8 1": 1e-6}), cache_path(key))
    used = plan_accuracy._calibration_used()
    assert used["path"] == str(cache_path(key))
    assert used["digest"] == load(cache_path(key)).digest()
    save(Machine(key, gemm={"float32 1 8 8 8 1": 2e-6}), cache_path(key))
    assert plan_accuracy._calibration_used()["digest"] != used["digest"]  # another content
