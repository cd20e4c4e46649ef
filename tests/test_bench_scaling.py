"""bench/scaling.py runs real ``mpiexec -n 1`` and ``-n 2`` jobs on tiny settings and writes its
tables, JSON and plot. Speed is never asserted: a 2-core CI box under load proves nothing."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import FASHION_DIR, run_bench

# never wait for a quiet machine in tests: the timings are not checked
QUIET_CHECK_OFF = ["--max-foreign", "99"]

pytestmark = pytest.mark.mpi


def run_script(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return run_bench("scaling.py", [*args, *QUIET_CHECK_OFF], timeout)


def test_strong_weak_and_threads_tiny(tmp_path: Path) -> None:
    proc = run_script(
        [
            "--dataset",
            "synthetic",
            "--synthetic-size",
            "256",
            "--hidden",
            "16,8",
            "--ranks",
            "1,2",
            "--epochs",
            "2",
            "--repeats",
            "1",
            "--batch-size",
            "64",
            "--per-rank-batch",
            "64",
            "--compare-threads",
            "--out",
            str(tmp_path),
        ]  # fmt: skip
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads((tmp_path / "scaling.json").read_text())
    png = (tmp_path / "scaling.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000
    strong, weak = out["strong"], out["weak"]
    assert [(e["ranks"], e["threads_per_rank"]) for e in strong] == [(1, 1), (2, 1), (1, 2)]
    assert [(e["ranks"], e["samples"]) for e in weak] == [(1, 256), (2, 512)]
    for e in strong + weak:
        assert e["time_s"] > 0 and e["efficiency"] > 0
        assert all(t > 0 for t in e["times_s"])
    assert strong[0]["speedup"] == pytest.approx(1.0)
    assert all(e["speedup"] > 0 for e in strong)
    assert {e["global_batch"] for e in strong} == {64}
    assert [e["global_batch"] for e in weak] == [64, 128]
    # weak N=1 and strong N=1 are the same command: run once, shared
    assert len(out["runs"]) == 4
    assert all(r["results"][0]["comm"] for r in out["runs"])
    for line in ("Strong scaling", "Weak scaling", "Speedup", "targets (informational)"):
        assert line in proc.stdout
    names = [t["name"] for t in out["targets"]]
    assert len(names) == 2 and all(t["pass"] is not None for t in out["targets"])


def test_oversubscription_warns(tmp_path: Path) -> None:
    proc = run_script(
        [
            "--dataset",
            "synthetic",
            "--synthetic-size",
            "128",
            "--hidden",
            "8",
            "--ranks",
            "1",
            "--mode",
            "strong",
            "--epochs",
            "2",
            "--repeats",
            "1",
            "--threads-per-rank",
            "64",
            "--out",
            str(tmp_path),
        ]  # fmt: skip
    )
    assert proc.returncode == 0, proc.stderr
    assert "oversubscribed" in proc.stdout
    out = json.loads((tmp_path / "scaling.json").read_text())
    assert out["weak"] is None and len(out["strong"]) == 1
    assert (tmp_path / "scaling.png").exists()


def test_failing_run_exits_nonzero(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XPNN_FAIL_AT", "0:1")  # the run's rank 0 raises at its second step
    proc = run_script(
        ["--dataset", "synthetic", "--synthetic-size", "128", "--hidden", "8", "--ranks", "1",
         "--mode", "strong", "--repeats", "1", "--out", str(tmp_path)],
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "run failed" in proc.stderr and "injected failure at step 1" in proc.stderr


def test_a_data_dir_without_the_data_is_refused_before_any_run(tmp_path: Path) -> None:
    """xpnn's own --data-dir check, made up front (before the 18th session, the first run
    failed on it: "run failed (exit 2): <command>", exit 1)."""
    proc = run_script(
        ["--dataset", "fashion-mnist", "--data-dir", str(tmp_path / "nowhere"), "--ranks", "1",
         "--mode", "strong", "--repeats", "1", "--out", str(tmp_path / "out")],
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr == (
        f"bench/scaling.py: error: --data-dir {tmp_path / 'nowhere'}: no such directory\n"
    )
    assert list(tmp_path.iterdir()) == []


FASHION_DEFAULT = str(FASHION_DIR) if FASHION_DIR.is_dir() else None


@pytest.mark.parametrize(
    ("dataset", "given", "passed"),
    [
        ("mnist", None, None),
        ("fashion-mnist", None, FASHION_DEFAULT),
        ("mnist", "MADE", "MADE"),
    ],
)
def test_default_data_dir_is_fashion_mnist_only(tmp_path: Path, dataset, given, passed) -> None:
    """The Fashion-MNIST folder is the default for fashion-mnist only: mnist without --data-dir
    passes none on (xpnn finds MNIST itself). Read from the command that a failing fake mpiexec
    makes the script print; nothing is trained. (MADE: a folder with the four files' names,
    which the --data-dir check before the runs looks for.)"""
    if given == "MADE":
        given = passed = str(tmp_path / "mnist")
        Path(given).mkdir()
        for name in ("train-images-idx3", "train-labels-idx1", "t10k-images-idx3"):
            (Path(given) / f"{name}-ubyte.gz").touch()
        (Path(given) / "t10k-labels-idx1-ubyte").touch()  # uncompressed is found too
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\nexit 3\n")
    fake.chmod(0o755)
    proc = run_script(
        ["--dataset", dataset, *(["--data-dir", given] if given else []), "--ranks", "1",
         "--mode", "strong", "--repeats", "1", "--mpiexec", str(fake), "--out", str(tmp_path)],
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1 and "run failed (exit 3)" in proc.stderr, proc.stderr
    assert f"--dataset {dataset} " in proc.stderr
    if passed is None:
        assert "--data-dir" not in proc.stderr
    else:
        assert f"--data-dir {passed} " in proc.stderr


def test_seed_style_full_batch_sgd_and_bad_batch(tmp_path: Path) -> None:
    """``--batch-size full --optimizer sgd`` (seed report 000's experiment) reaches the CLI."""
    proc = run_script(
        ["--dataset", "synthetic", "--synthetic-size", "200", "--hidden", "8", "--ranks", "2",
         "--mode", "strong", "--epochs", "2", "--repeats", "1", "--batch-size", "full",
         "--optimizer", "sgd", "--out", str(tmp_path)],
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "batch full" in proc.stdout
    strong = json.loads((tmp_path / "scaling.json").read_text())["strong"]
    assert [e["global_batch"] for e in strong] == ["full", "full"]
    bad = run_script(["--batch-size", "0"], timeout=30)
    assert bad.returncode == 2 and "--batch-size" in bad.stderr


@pytest.mark.parametrize("parallel", ["tensor", "pipeline"])
def test_model_parallel_strong_scaling_reaches_the_cli(tmp_path: Path, parallel: str) -> None:
    """``--parallel tensor|pipeline`` runs every configuration that way; the data-parallel
    targets are not judged on it, and weak scaling (a batch per rank) is refused."""
    proc = run_script(
        ["--dataset", "synthetic", "--synthetic-size", "256", "--hidden", "16,8", "--ranks", "2",
         "--mode", "strong", "--epochs", "2", "--repeats", "1", "--batch-size", "64",
         "--parallel", parallel, "--microbatches", "2", "--out", str(tmp_path),
         *(["--pipeline-schedule", "1f1b", "--recompute"] if parallel == "pipeline" else [])],
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert f"{parallel} parallel" in proc.stdout and "targets" not in proc.stdout
    out = json.loads((tmp_path / "scaling.json").read_text())
    assert out["config"]["parallel"] == parallel and out["targets"] == []
    assert [(e["ranks"], e["global_batch"]) for e in out["strong"]] == [(1, 64), (2, 64)]
    assert {r["results"][0]["parallel"] for r in out["runs"]} == {parallel}
    if parallel == "pipeline":  # the 2-rank run; the 1-rank one is no pipeline
        assert out["runs"][-1]["results"][0]["pipeline_schedule"] == "1f1b"
        assert out["runs"][-1]["results"][0]["recompute"] is True
    bad = run_script(["--parallel", parallel], timeout=30)
    assert (
        bad.returncode == 2
        and f"--parallel {parallel}" in bad.stderr
        and "--mode strong" in bad.stderr
    )


def _scaling_module(monkeypatch: pytest.MonkeyPatch):
    """bench/scaling.py as a module (it imports ``_common`` from its own folder, and its
    dataclasses look themselves up in ``sys.modules``)."""
    import importlib.util
    import sys

    from conftest import ROOT

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("scaling_under_test", ROOT / "bench/scaling.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_the_targets_say_how_many_repeats_met_them(capsys, monkeypatch) -> None:
    """The verdict is on the median of the per-repeat ratios; the line also gives their range
    and how many met the target, since single repeats straddle it on a noisy machine."""
    import argparse

    scaling = _scaling_module(monkeypatch)
    args = argparse.Namespace(parallel="data", hidden="1024,1024", dataset="fashion-mnist")
    row = lambda ranks, threads, times: {  # noqa: E731
        "ranks": ranks, "threads_per_rank": threads, "times_s": times,
        "speedup": scaling.paired_median_ratio([6.0, 6.0, 6.0], times),
    }  # fmt: skip
    summary = {
        "strong": [
            row(1, 1, [6.0, 6.0, 6.0]), row(2, 1, [3.0, 3.5, 3.2]), row(1, 2, [3.3, 3.4, 3.3]),
        ]
    }  # fmt: skip
    speedup, threads = scaling.targets(args, summary)
    assert speedup["per_repeat"] == pytest.approx([2.0, 6 / 3.5, 6 / 3.2])
    assert speedup["value"] == pytest.approx(6 / 3.2) and speedup["pass"]
    assert speedup["repeats_meeting"] == 2  # 1.714 does not meet 1.8
    assert threads["per_repeat"] == pytest.approx([1.1, 3.4 / 3.5, 3.3 / 3.2])
    assert threads["repeats_meeting"] == 2 and threads["pass"]
    scaling.print_targets([speedup, threads])
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].startswith("  PASS         strong speedup 2 ranks x 1 thread vs 1 rank x")
    assert lines[2].endswith(": 1.875 (target >= 1.8; per repeat 1.714-2.000, 2 of 3 meet it)")
    assert lines[3].endswith(": 1.031 (target > 1; per repeat 0.971-1.100, 2 of 3 meet it)")


def test_a_run_with_one_epoch_is_not_timed_by_it(monkeypatch) -> None:
    """The first epoch includes compilation: a run that recorded only it is a failed run, not
    timed by that epoch (before the 18th session, ``seconds[1:] or seconds`` timed it)."""
    scaling = _scaling_module(monkeypatch)
    epoch = lambda s: {"event": "epoch", "seconds": s}  # noqa: E731
    assert scaling.epoch_time([epoch(9.0), epoch(2.0), epoch(4.0)]) == (3.0, [9.0, 2.0, 4.0])
    with pytest.raises(RuntimeError, match="1 epoch record"):
        scaling.epoch_time([epoch(9.0)])


def test_the_summary_keeps_the_times_the_targets_divide(monkeypatch) -> None:
    """The tables' ``times_s`` were rounded to 4 decimals and the targets' per-repeat ratios
    divided those: short runs printed a median (1.136) that was not the median of the ratios
    printed beside it."""
    scaling = _scaling_module(monkeypatch)
    one = scaling.RunSpec(1, 1, 300, 1, 300, 128, None)
    two = scaling.RunSpec(2, 1, 300, 1, 300, 128, None)
    raw = {one: [0.72957, 0.74337], two: [0.62172, 0.67667]}
    runs = {
        spec: [{"time_s": t, "foreign_cores": 0.0, "comm": "mpi-shm"} for t in times]
        for spec, times in raw.items()
    }
    summary = scaling.summarise({"strong": [("1", one), ("2", two)]}, runs)
    assert [e["times_s"] for e in summary["strong"]] == [raw[one], raw[two]]


def test_the_plot_puts_each_row_at_the_cores_it_used(monkeypatch, tmp_path) -> None:
    """With 2 threads per rank, 1 x 2 and 2 x 2 were drawn at x = 1 and 2 (their ranks) on an
    axis of cores used, whose ticks were 2 and 4."""
    pytest.importorskip("matplotlib")
    scaling = _scaling_module(monkeypatch)
    drawn = []
    plt = scaling.pyplot_agg()
    real = plt.Axes.plot

    def record(ax, *args, **kwargs):
        drawn.append((list(args[0]), kwargs.get("label")))
        return real(ax, *args, **kwargs)

    monkeypatch.setattr(plt.Axes, "plot", record)
    row = lambda ranks, threads: {  # noqa: E731
        "ranks": ranks, "threads_per_rank": threads, "time_s": 1.0 / ranks, "efficiency": 1.0,
    }  # fmt: skip
    scaling.plot({"strong": [row(1, 2), row(2, 2)]}, tmp_path / "s.png", "t")
    assert ([2, 4], "strong scaling") in drawn
