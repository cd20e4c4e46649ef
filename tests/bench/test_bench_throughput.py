"""``python -m bench throughput`` on tiny settings: one record per model, backend and batch,
with what was run, positive medians, and the PyTorch side and the ratio exactly where PyTorch
ran. Speed is never asserted (the numbers depend on the machine and its load).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
from pathlib import Path

import pytest
from conftest import run_bench

from bench.benchmarks.throughput import alternate
from bench.core import read_records

HAS_TORCH = importlib.util.find_spec("torch") is not None
# never wait for a quiet machine in tests: the timings are not checked
TINY = "--steps 2 --warmup 1 --repeats 2 --threads 1 --hidden 16 --max-foreign 99 --gap 0"
CONFIG_KEYS = {"loop", "model", "backend", "batch", "threads", "steps", "warmup", "hidden"}


def bench(args: list[str], timeout: float = 180, **env: str) -> subprocess.CompletedProcess:
    return run_bench("throughput", *args, timeout=timeout, env={**os.environ, **env})


def check_torch_side(r: dict, repeats: int, ran: bool) -> None:
    """PyTorch's samples/s and the per-round ratio where it ran; neither where it did not."""
    m = r["metrics"]
    if not ran:
        assert "torch_samples_per_s" not in m and "xpnn_over_torch" not in m
        return
    x, t = m["xpnn_samples_per_s"]["samples"], m["torch_samples_per_s"]["samples"]
    assert len(t) == repeats and min(t) > 0
    assert m["xpnn_over_torch"]["samples"] == pytest.approx(
        [a / b for a, b in zip(x, t, strict=True)]
    )


def test_records_of_every_backend_and_batch(tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    proc = bench(["--backends", "numpy,numba", "--batches", "8,32", "--no-torch", *TINY.split()]
                 + ["--out", str(out)])  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rs = read_records(out, "throughput")
    assert [(r["config"]["backend"], r["config"]["batch"]) for r in rs] == [
        ("numpy", 8), ("numba", 8), ("numpy", 32), ("numba", 32),
    ]  # fmt: skip
    pids = set()
    for r in rs:
        c, m = r["config"], r["metrics"]
        assert CONFIG_KEYS <= c.keys() and c["model"] == "mlp" and c["hidden"] == [16]
        assert (c["loop"], c["threads"], c["steps"], c["warmup"]) == ("steps", 1, 2, 1)
        assert r["repeats"] == 2 and r["machine"]["cores"] >= 1
        stat = m["xpnn_samples_per_s"]
        assert len(stat["samples"]) == 2 and 0 < stat["min"] <= stat["median"] <= stat["max"]
        check_torch_side(r, 2, ran=False)  # --no-torch: no torch column, no ratio
        assert c["torch_device"] is None and r["info"]["torch_skipped"] == "--no-torch"
        (worker,) = r["info"]["workers"].values()  # its own process, limited to 1 thread
        assert worker["threads"]["threads"] == 1 and worker["params"] == 784 * 16 + 16 + 170
        pids.add(worker["pid"])
        assert len(r["info"]["foreign_cores"]) == 2
    assert len(pids) == 2  # one worker per backend, kept across batches
    assert proc.stdout.count("| mlp | num") == 4
    assert "xpnn/torch" not in proc.stdout  # --no-torch: a column of dashes is left out
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    again = bench(["--from", str(out), "--out", str(out)])  # redrawn from the records alone
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("| mlp | num") == 4 and out.read_text().count("\n") == 4


def test_the_torch_side_runs_exactly_when_pytorch_is_importable(tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    args = ["--model", "cnn", "--backends", "numba", "--batches", "4", *TINY.split()]
    proc = bench([*args, "--repeats", "1", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr
    (r,) = read_records(out, "throughput")
    assert r["config"]["model"] == "cnn" and r["config"]["hidden"] is None
    check_torch_side(r, 1, ran=HAS_TORCH)
    workers = r["info"]["workers"]
    if HAS_TORCH:  # the same network on both sides, parameter for parameter
        assert r["config"]["torch_device"] == "cpu"
        assert workers["torch-cpu"]["params"] == workers["xpnn-numba"]["params"] == 690_590
    else:
        assert r["config"]["torch_device"] is None and "torch-cpu" not in workers
        assert r["info"]["torch_skipped"].startswith("PyTorch is not importable")
        assert "torch comparison skipped: PyTorch is not importable" in proc.stdout


def test_each_sides_peak_memory_and_their_ratio_are_recorded_and_tabled(tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    torch = [] if HAS_TORCH else ["--no-torch"]
    args = ["--model", "cnn", "--backends", "numba", "--batches", "4", *TINY.split(), *torch]
    proc = bench([*args, "--repeats", "1", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr
    (r,) = read_records(out, "throughput")
    peaks = r["info"]["peak_rss_mb"]
    assert 50 < peaks["xpnn"] < 4096  # a process with NumPy and Numba loaded
    assert "| xpnn peak MiB |" in proc.stdout and "xpnn_peak" not in str(r["metrics"])
    if HAS_TORCH:
        assert 50 < peaks["torch"] < 4096
        ratio = f"| {peaks['xpnn'] / peaks['torch']:.2f} |"
        assert "| torch peak MiB | peak, xpnn:torch |" in proc.stdout and ratio in proc.stdout
    else:
        assert "torch" not in peaks and "torch peak MiB" not in proc.stdout


def test_the_torch_backend_runs_beside_the_same_network_in_torch_nn(tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    proc = bench(["--backends", "torch", "--batches", "4", *TINY.split(), "--out", str(out)])
    assert proc.returncode == 0, proc.stderr
    (r,) = read_records(out, "throughput")
    assert r["config"]["backend"] == "torch" and r["config"]["torch_device"] == "cpu"
    check_torch_side(r, 2, ran=True)
    workers = r["info"]["workers"]
    assert workers["xpnn-torch"]["device"] == "cpu"
    assert workers["xpnn-torch"]["params"] == workers["torch-cpu"]["params"] == 784 * 16 + 186


@pytest.mark.mpi
def test_ranks_compare_times_the_cli_under_mpiexec(tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    args = ["--backends", "numpy", "--batches", "8", "--ranks-compare", "--ranks-samples", "256"]
    args += ["--ranks-batch", "64", "--ranks-repeats", "2", *TINY.split(), "--out", str(out)]
    proc = bench(args)
    assert proc.returncode == 0, proc.stderr
    steps, cli = read_records(out, "throughput")
    assert steps["config"]["loop"] == "steps"
    c = cli["config"]
    assert (c["loop"], c["ranks"], c["threads"], c["batch"], c["samples"]) == ("cli", 2, 1, 64, 256)
    assert cli["metrics"]["xpnn_samples_per_s"]["min"] > 0 and cli["repeats"] == 2
    assert "--threads" in cli["info"]["command"] and c["torch_threads"] == (
        1 if HAS_TORCH else None
    )
    check_torch_side(cli, 2, ran=HAS_TORCH)
    assert "2 ranks × 1 thread" in proc.stdout


@pytest.mark.mpi
def test_a_failed_cli_run_names_the_run_and_its_reason(tmp_path: Path) -> None:
    """Rank 0 of the ``mpiexec -n 2 python -m xpnn`` run raises at its first step: exit 1, the
    command and xpnn's own line, no traceback of ours, no records."""
    out = tmp_path / "t.jsonl"
    args = ["--backends", "numpy", "--batches", "8", "--ranks-compare", "--ranks-samples", "256"]
    proc = bench([*args, *TINY.split(), "--out", str(out)], XPNN_FAIL_AT="0:0")
    assert proc.returncode == 1, proc.stderr
    first = proc.stderr.splitlines()[0]
    assert first.startswith("bench: a measured run failed: exit ") and " -m xpnn " in first
    assert "injected failure at step 0" in proc.stderr and not out.exists()


def _cupy_usable() -> bool:
    from xpnn.backends import gpu_unavailable_reason

    return gpu_unavailable_reason() is None


@pytest.mark.skipif(_cupy_usable(), reason="CuPy and a CUDA device work here: cupy rows run")
def test_no_runnable_backend_is_one_line_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    proc = bench(["--backends", "cupy", "--out", str(out)], timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("bench: --backends: none can run here (cupy: ")
    assert not out.exists()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--steps", "0"], "--steps: must be >= 1"),
        (["--backends", ","], "--backends: empty"),
        (["--backends", "tensorflow"], "--backends: unknown 'tensorflow'"),
        (["--backends", "numpy,numba,numpy"], "--backends: 'numpy' given twice"),
        (["--batches", "32,32"], "--batches: 32 given twice in '32,32'"),
        (["--retries", "-1"], "--retries: must be >= 0"),
        (["--gap", "-1"], "--gap: must be >= 0"),
        (["--gap", "nan"], "--gap: must be a finite number"),
        (["--seed", "-1"], "--seed: must be >= 0"),
        (["--model", "rnn"], "--model: invalid choice: 'rnn'"),
        # the first epoch is not timed: one epoch would time nothing
        (["--ranks-compare", "--ranks-epochs", "1"], "--ranks-epochs: must be >= 2, got 1"),
    ],
)
def test_a_bad_argument_is_one_line_exit_2(args: list[str], needle: str) -> None:
    proc = bench(args, timeout=60)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()  # no usage block, no traceback
    assert needle in line and proc.stdout == ""


def test_sides_alternate_and_each_keeps_its_own_numbers() -> None:
    """A B, B A, A B: the ratio of a round compares measurements taken side by side, and
    every number goes back to the side that produced it, whatever the order."""
    calls: list[str] = []

    def side(name: str, value: float):
        return (lambda: calls.append(f"prepare {name}"), lambda: calls.append(name) or value)

    quiet = argparse.Namespace(gap=0.0, max_foreign=99.0, retries=0, quiet_timeout=0.0)
    numbers, foreign, redone = alternate([side("a", 1.0), side("b", 2.0)], 3, quiet, [])
    assert [c for c in calls if not c.startswith("prepare")] == ["a", "b", "b", "a", "a", "b"]
    assert calls[:2] == ["prepare a", "a"]  # each side prepared right before it is timed
    assert numbers == [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]]
    assert len(foreign) == 3 and redone == 0


def test_graphs_and_torch_compile_are_said_and_left_out_where_they_cannot_run(tmp_path: Path):
    """On the CPU: no recording backend (graphs: cupy), no GPU for a compiled PyTorch."""
    out = tmp_path / "t.jsonl"
    args = ["--backends", "numpy", "--batches", "8", "--graphs", "--torch-compile", "--no-torch"]
    proc = bench([*args, *TINY.split(), "--out", str(out)])
    assert proc.returncode == 0, proc.stderr
    assert "graphs skipped for numpy: backend numpy runs each operation" in proc.stdout
    (r,) = read_records(out, "throughput")
    assert set(r["metrics"]) == {"xpnn_samples_per_s"} and "sides" not in r["config"]
    assert r["info"]["graph_numpy_skipped"].startswith("backend numpy")


def test_the_extra_sides_ratios_pair_each_rounds_numbers() -> None:
    from bench.benchmarks.throughput import _all_samples

    rates = {"xpnn": [4.0, 6.0], "xpnn_graph": [8.0, 9.0], "torch": [2.0, 3.0]}
    rates["torch_compiled"] = [4.0, 3.0]
    got = _all_samples(rates)
    assert got["graph_over_torch"] == [4.0, 3.0] and got["xpnn_over_torch"] == [2.0, 2.0]
    assert got["graph_over_compiled"] == [2.0, 3.0] and got["xpnn_over_compiled"] == [1.0, 2.0]
    assert got["torch_compiled_samples_per_s"] == [4.0, 3.0]
    assert "graph_over_torch" not in _all_samples({"xpnn": [1.0], "torch": [1.0]})


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_the_graph_sides_loop_trains_as_the_eager_one(model: str) -> None:
    """``--graphs``' worker loop (static inputs, the recorder) on NumPy, its recording a
    stand-in that runs the step again: the eager loop's parameters, exactly."""
    import numpy as np

    from bench.benchmarks._throughput_workers import XpnnTrainer, random_batches
    from xpnn.backends import get_backend

    params = []
    for graph in (False, True):
        backend = get_backend("numpy", "float32")
        if graph:
            backend.capture = lambda fn: fn
        trainer = XpnnTrainer(backend, model, (32, 16), graph=graph)
        trainer.epoch(5, trainer.device_batches(random_batches(3, 8, 0)))
        params.append(np.array(trainer.model.params))
    np.testing.assert_array_equal(params[1], params[0])
