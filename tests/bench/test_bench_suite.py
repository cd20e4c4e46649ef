"""The benchmark suite: its records carry what was run, on what, and medians with ranges."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from conftest import ROOT, run_bench

from bench.benchmarks import batch_regimes
from bench.core import read_records
from bench.report import check

bench = run_bench


def assert_schema(r: dict, name: str) -> None:
    assert r["schema"] == 1 and r["benchmark"] == name
    m = r["machine"]
    assert m["cores"] >= 1 and m["cpu"] and m["mpi"].startswith("MPICH")
    assert m["blas"] and m["blas"][0]["internal_api"] and "architecture" in m["blas"][0]
    for stat in r["metrics"].values():
        assert stat["min"] <= stat["median"] <= stat["max"]
        assert len(stat["samples"]) == r["repeats"] or r["repeats"] == 0


def test_list_names_every_benchmark():
    proc = bench("LIST")
    assert proc.returncode == 0, proc.stderr
    names = [line.split()[0] for line in proc.stdout.splitlines()]
    assert names == [
        "scaling", "cnn", "granularity", "batch_regimes", "parallel_modes", "crossover",
        "allreduce", "polling", "gemm_split", "throughput", "optimizer_step", "core_contention",
        "within_job", "step_phases", "staging", "gpt", "trace_cost", "plan_accuracy", "limit",
        "python_loop",
    ]  # fmt: skip


def test_an_unknown_benchmark_is_one_line_exit_2():
    proc = bench("nosuch")
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "bench: unknown benchmark 'nosuch'; `python -m bench LIST` names them"
    )


def test_scaling_records_strong_and_weak(tmp_path):
    out = tmp_path / "s.jsonl"
    proc = bench(
        "scaling", "--ranks", "1,2", "--samples", "300", "--replicate", "4", "--epochs", "2",
        "--hidden", "16", "--repeats", "2", "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rs = read_records(out, "scaling")
    assert [(r["config"]["mode"], r["config"]["ranks"]) for r in rs] == [
        ("strong", 1), ("strong", 2), ("weak", 1), ("weak", 2),
    ]  # fmt: skip
    for r in rs:
        assert_schema(r, "scaling")
        assert r["repeats"] == 2 and len(r["metrics"]["train_s"]["samples"]) == 2
        assert r["info"]["world_size"] == r["config"]["ranks"]  # the run really had N ranks
        assert r["config"]["activation"] == "sigmoid" and r["config"]["loss"] == "sigmoid_bce"
        assert r["config"]["batch_size"] == "full"
        assert len(r["info"]["curve"]) == 2
    # strong: the same 1,200 samples; weak: 300 per rank
    assert [r["config"]["train_samples"] for r in rs] == [1200, 1200, 300, 600]
    assert "strong scaling" in proc.stdout and "weak scaling" in proc.stdout
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


def test_a_table_is_redrawn_from_records_without_measuring(tmp_path):
    out = tmp_path / "a.jsonl"
    proc = bench("allreduce", "--quick", "--max-size", "1024", "--iters", "3", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    rs = read_records(out, "allreduce")
    assert [r["config"]["size_bytes"] for r in rs] == [4, 64, 1024]
    for r in rs:
        assert_schema(r, "allreduce")
        assert r["config"]["ranks"] == 2 and r["config"]["buffers"] == "host"
        assert r["metrics"]["latency_us"]["median"] > 0
        assert r["metrics"]["raw_latency_us"]["median"] > 0
    again = bench("allreduce", "--from", str(out))
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("| host |") == 3
    assert out.read_text().count("\n") == 3  # --from appends nothing


def test_crossover_runs_as_a_script_of_its_own(tmp_path):
    out = tmp_path / "c.jsonl"
    cmd = [sys.executable, "bench/matmul_crossover.py", "--sizes", "8,32", "--no-extra"]
    cmd += ["--dtypes", "float64", "--repeats", "3", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    rs = read_records(out, "crossover")
    assert [(r["config"]["n"], r["config"]["dtype"]) for r in rs] == [
        (8, "float64"),
        (32, "float64"),
    ]
    for r in rs:
        assert_schema(r, "crossover")
        assert r["repeats"] == 3 and r["metrics"]["cpu_ms"]["median"] > 0
        if r["machine"]["gpu"] is None:
            assert r["info"]["gpu_skipped"] and "e2e_ms" not in r["metrics"]


def test_steps_to_target_interpolates_between_evaluations():
    curve = [(10, 0.5), (20, 0.9)]
    assert batch_regimes.steps_to_target(curve, 0.7) == 15.0
    assert batch_regimes.steps_to_target(curve, 0.95) is None
    assert batch_regimes.steps_to_target(curve, 0.4) == 10.0  # met at the first score


def test_the_watch_scores_about_ten_percent_apart_and_stops_at_the_target():
    class Trainer:  # the one method the callback calls: accuracy rises 0.001 a step
        step = 0

        def evaluate(self):
            return 0.0, 0.001 * self.step

    trainer, watch = Trainer(), batch_regimes.TargetWatch(target=0.5, max_steps=10_000)
    with pytest.raises(batch_regimes._Stop):
        for step in range(10_000):
            trainer.step = step + 1
            watch.on_step_end(trainer, step)
    steps = [s for s, _ in watch.curve]
    assert steps[:10] == list(range(1, 11)) and steps[-1] >= 500 > steps[-2]
    assert all(b <= max(a + 1, math.ceil(a * 1.1)) for a, b in zip(steps, steps[1:], strict=False))
    assert len(steps) < 60  # not every step
    assert batch_regimes.steps_to_target(watch.curve, 0.5) == pytest.approx(500)


def test_the_watch_gives_up_on_a_rate_whose_best_score_is_four_times_as_old():
    class Trainer:  # best around step 60, worse after: a diverged learning rate
        step = 0

        def evaluate(self):
            return 0.0, 0.3 if 55 <= self.step <= 65 else 0.1

    trainer, watch = Trainer(), batch_regimes.TargetWatch(target=0.9, max_steps=10_000)
    with pytest.raises(batch_regimes._Stop):
        for step in range(10_000):
            trainer.step = step + 1
            watch.on_step_end(trainer, step)
    best = next(s for s, a in watch.curve if a == 0.3)
    assert 4 * best <= watch.curve[-1][0] < 4.4 * best  # at the first score past 4 x best
    assert batch_regimes.steps_to_target(watch.curve, 0.9) is None


def test_the_plot_of_a_study_where_no_batch_reached_the_target(tmp_path):
    from bench.plots import pyplot

    plt = pyplot()
    fig, ax = plt.subplots()
    rec = {"config": {"batch": 8, "lr": 0.1}, "metrics": {"seconds": {"median": 1.0}}}
    batch_regimes.plot([rec], ax)  # no steps: says so, no log scale of nothing
    fig.savefig(tmp_path / "b.png")
    assert "no batch size reached the target" in [t.get_text() for t in ax.texts]


def test_report_check_finds_empty_tables_and_bad_pngs(tmp_path):
    (tmp_path / "index.md").write_text("# r\n\n| a | b |\n|---|---|\n\n![x](x.png)\n")
    (tmp_path / "x.png").write_bytes(b"not a png")
    problems = check(tmp_path)
    assert any("without rows" in p for p in problems)
    assert any("not a PNG" in p for p in problems)
    (tmp_path / "index.md").write_text("# r\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n![x](x.png)\n")
    (tmp_path / "x.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"0" * 8)
    assert check(tmp_path) == []


@pytest.mark.parametrize(
    "path", sorted((ROOT / "bench" / "recorded").glob("gpu-*.jsonl")), ids=lambda p: p.name
)
def test_the_recorded_gpu_results_name_machine_and_date(path):
    rs = [json.loads(line) for line in path.read_text().splitlines()]
    assert {"crossover", "allreduce"} <= {r["benchmark"] for r in rs}  # what the report shows
    kind, date = path.stem.split("-")[1], path.stem[-10:]  # gpu-h200-2026-11-26
    for r in rs:
        assert r["machine"]["gpu"]["name"].lower().startswith(f"nvidia {kind}")
        assert r["time"].startswith(date) and "bash ci/gpu.sh" in r["info"]["source"]
        assert "\\u0000" not in json.dumps(r)  # Open MPI's version string ends in a NUL
        assert all(math.isfinite(m["median"]) for m in r["metrics"].values())


def test_the_report_shows_the_newest_recording():
    from bench.report import RECORDED_GPU

    newest = max((ROOT / "bench" / "recorded").glob("gpu-*.jsonl"), key=lambda p: p.stem[-10:])
    assert RECORDED_GPU == newest and RECORDED_GPU.name == "gpu-h200-2026-11-26.jsonl"


def test_gemm_split_times_every_product_at_both_batches(tmp_path):
    out = tmp_path / "g.jsonl"
    proc = bench(
        "gemm_split", "--inputs", "6", "--hidden", "8", "--classes", "3", "--batch", "5",
        "--ranks", "2", "--samples", "2", "--seconds", "0", "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rs = read_records(out, "gemm_split")
    assert [r["config"]["product"] for r in rs] == [
        "layer 0 forward", "layer 0 weight grad",  # no input gradient for the data
        "layer 1 forward", "layer 1 weight grad", "layer 1 input grad",
    ]  # fmt: skip
    for r in rs:
        assert_schema(r, "gemm_split")
        assert r["config"]["share"] == 3  # the larger share of 5 rows on 2 ranks
        share, whole = r["metrics"]["share_us"]["samples"], r["metrics"]["whole_us"]["samples"]
        ratios = [a / b for a, b in zip(share, whole, strict=True)]
        assert r["metrics"]["ratio"]["samples"] == ratios
    assert "ideal ratio 0.500" in proc.stdout


def test_a_batch_below_the_ranks_is_refused_in_one_line():
    proc = bench("gemm_split", "--batch", "1", "--ranks", "2")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "bench: --batch 1 is below --ranks 2: a rank would get no rows"


@pytest.mark.parametrize(
    ("argv", "copies"),
    [
        (["--dataset", "synthetic", "--samples", "5000"], 12),  # seed 000's 5,000 x 12
        (["--dataset", "fashion-mnist"], 1),  # already 60,000
        (["--dataset", "fashion-mnist", "--replicate", "3"], 3),
    ],
)
def test_strong_scaling_replicates_the_set_to_seed_000s_60000_samples(argv, copies):
    from bench.benchmarks import parse, scaling

    assert scaling.strong_copies(parse("scaling", argv)) == copies
