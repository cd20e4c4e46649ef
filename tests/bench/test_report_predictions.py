"""The studies report sets the planner's prediction beside each measurement: a "predicted"
column in each study's table, computed by the planner from the record's own command line, and
a predicted line in its figure; the GPU crossover says it has no prediction."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from test_figures import check_axes  # noqa: E402

from bench.benchmarks import load  # noqa: E402
from bench.predicted import LABEL, NO_GPU, annotate, run_of  # noqa: E402
from bench.report import check, panels, redraw  # noqa: E402
from xpnn.commands import predict_run  # noqa: E402
from xpnn.planner import Layout, Machine  # noqa: E402
from xpnn.planner import load as load_calibration  # noqa: E402
from xpnn.planner.machine import save  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OPS = ("allreduce", "reduce_scatter", "allgather", "bcast", "sendrecv")


def round_calibration(path: Path, cores: int = 2) -> str:
    """1 GFLOP/s a thread for a few product sizes, 1e9 values/s, alpha 1 us, beta 1 ns/B."""
    gemm = {
        f"float32 {t} {n} {n} {n} 1": 2 * n**3 / (1e9 * t)
        for t in range(1, cores + 1)
        for n in (8, 64, 512)
    }
    comm = {str(r): {op: [1e-6, 1e-9] for op in OPS} for r in range(2, cores + 1)}
    machine = Machine(
        {"cores": cores, "host": "round"},
        gemm=gemm,
        bandwidth={f"float32 {t}": 1e9 for t in range(1, cores + 1)},
        comm=comm,
    )
    save(machine, path)
    return str(path)


def record(ranks: int, width: int, seconds: float) -> dict:
    """A granularity record made by hand: 1,000 synthetic samples, batch 100, 2 epochs."""
    launch = f"mpiexec -n {ranks} " if ranks > 1 else ""
    command = (
        f"{launch}python -m xpnn --model mlp --hidden {width} --optimizer sgd --lr 0.05 "
        "--batch-size 100 --epochs 2 --dataset synthetic --synthetic-size 1000 --threads 1 "
        "--seed 0 --metrics m.jsonl"
    )
    stat = {"median": seconds, "min": seconds, "max": seconds, "samples": [seconds]}
    return {
        "benchmark": "granularity",
        "config": {
            "width": width,
            "ranks": ranks,
            "threads": 1,
            "batch_size": 100,
            "epochs": 2,
            "dataset": "synthetic",
            "macs_per_sample": 794 * width,
            "command": command,
        },  # fmt: skip
        "metrics": {"epoch_s": stat},
        "repeats": 1,
    }


def test_the_predicted_column_is_the_planners_step_times_the_steps(tmp_path, monkeypatch):
    cal = round_calibration(tmp_path / "cal.json")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    records = [record(n, w, 0.5 * w / 64 / n) for w in (64, 512) for n in (1, 2)]
    annotate(records, cal)
    assert not (tmp_path / "cache").exists()  # a calibration file: nothing measured or kept
    for r in records:
        flags, layout, samples = run_of(r["config"])
        assert layout == Layout(ranks=r["config"]["ranks"], threads=1, comm="auto")
        assert samples == 1000
        pred, batch = predict_run(flags, layout, cal)
        assert batch == 100
        assert r["predicted"]["epoch_s"] == pytest.approx(10 * pred.step, rel=1e-12)
        assert r["predicted"]["train_s"] == pytest.approx(20 * pred.step, rel=1e-12)
    one = {r["config"]["width"]: r for r in records if r["config"]["ranks"] == 1}
    assert one[512]["predicted"]["epoch_s"] > one[64]["predicted"]["epoch_s"]  # more work
    table = load("granularity").table(records)
    head, _, *rows = table.splitlines()
    assert "| predicted epoch s | predicted speedup |" in head
    assert f"{records[0]['predicted']['epoch_s']:.3g}" in rows[0]
    for r in rows:
        assert "–" not in r  # every row predicted


def test_a_full_batch_and_a_per_rank_batch_are_priced_as_the_run_took_them(tmp_path):
    scaling = {"command": "mpiexec -n 2 python -m xpnn --model mlp --hidden 64 --batch-size "
               "full --epochs 3 --dataset synthetic --synthetic-size 500 --replicate 4 "
               "--threads 1", "train_samples": 2000}  # fmt: skip
    flags, layout, samples = run_of(scaling)
    assert samples == 2000 and flags[flags.index("--batch-size") + 1] == "2000"
    assert layout.ranks == 2 and layout.parallel == "data"
    cnn = {"command": "mpiexec -n 2 python -m xpnn --model cnn --per-rank-batch 128 "
           "--parallel pipeline --microbatches 4 --pipeline-schedule 1f1b --threads 1"}  # fmt: skip
    flags, layout, samples = run_of(cnn)
    assert flags[flags.index("--batch-size") + 1] == "256" and samples == 60_000
    assert (layout.parallel, layout.microbatches, layout.schedule) == ("pipeline", 4, "1f1b")
    cal = round_calibration(tmp_path / "cal.json")
    r = {"config": scaling}
    annotate([r], cal)
    assert r["predicted"]["steps_per_epoch"] == 1
    assert r["predicted"]["train_s"] == pytest.approx(3 * r["predicted"]["step_s"], rel=1e-12)


def test_every_study_figure_draws_the_predicted_line(tmp_path):
    cal = round_calibration(tmp_path / "cal.json")
    recorded = [json.loads(line) for line in (ROOT / "docs/report/records.jsonl").open()]
    for name in ("scaling", "cnn", "granularity", "parallel_modes"):
        rs = [r for r in recorded if r["benchmark"] == name]
        annotate(rs, cal)
        drawn = panels(name, rs)
        fig, axes = plt.subplots(1, len(drawn), squeeze=False)
        try:
            for ax, panel in zip(axes[0], drawn, strict=True):
                panel(ax)
            fig.canvas.draw()
            check_axes(fig, name)
            lines = [line for ax in fig.axes for line in ax.get_lines()]
            mine = [line for line in lines if LABEL in str(line.get_label())]
            assert mine, f"{name}: no predicted line"
            ys = [float(y) for line in mine for y in line.get_ydata()]
            assert ys and all(math.isfinite(y) and y > 0 for y in ys), (name, ys)
        finally:
            plt.close(fig)


def test_the_report_redrawn_says_what_it_predicted_and_what_not(tmp_path):
    cal = round_calibration(tmp_path / "cal.json")
    out = tmp_path / "report"
    out.mkdir()
    shutil.copy(ROOT / "docs" / "report" / "records.jsonl", out)
    index = redraw(out, cal)
    assert check(out) == []
    text = index.read_text()
    assert LABEL in text and cal in text
    assert text.count("| predicted epoch s |") >= 3  # cnn, granularity, parallel modes
    assert "predicted speedup |" in text and NO_GPU.lower() in text.lower()
    assert "the planner does not model --recompute" in text


def test_a_bad_calibration_file_is_refused_in_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "report", "--redraw", "--out", str(tmp_path),
         "--calibration", str(tmp_path / "none.json")],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"bench report: --calibration: {tmp_path / 'none.json'}: no such calibration file"
    ]


def test_the_report_names_the_machine_it_predicts_for(tmp_path):
    from bench.report import QUICK_CALIBRATION, predictions_text

    cal = round_calibration(tmp_path / "cal.json")
    assert load_calibration(QUICK_CALIBRATION).cores == 2  # the quick report's, recorded
    other = predictions_text(cal, {"cpu": "Intel(R) Xeon(R) Processor", "cores": 2})
    assert cal in other and "**Predicted for another machine than the one measured**" in other
    same = predictions_text(cal, {"cpu": None, "cores": 2})  # the round machine names no CPU
    assert "another machine" not in same
