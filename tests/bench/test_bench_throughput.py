"""bench/throughput.py runs end to end on tiny settings and writes a complete JSON file.

Speed is never asserted (the numbers depend on the machine and its load): only that every
configuration was measured, the numbers are positive, and the PyTorch side appears exactly when
PyTorch is importable.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
from conftest import run_bench

# never wait for a quiet machine in tests: the timings are not checked
QUIET_CHECK_OFF = ["--max-foreign", "99", "--gap", "0"]
TINY = "--steps 1 --warmup 1 --repeats 1".split()  # one timed step: enough to fill the JSON
HAS_TORCH = importlib.util.find_spec("torch") is not None
ROW_KEYS = {
    "model",
    "backend",
    "batch",
    "threads",
    "steps",
    "repeats",
    "xpnn_samples_per_s",
    "xpnn_samples_per_s_all",
    "torch_samples_per_s",
    "ratio",
    "ratios",
    "foreign_cores",
}


def run_script(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return run_bench("throughput.py", [*args, *QUIET_CHECK_OFF], timeout)


def check_rows(out: dict, model: str, backends: list[str], batches: list[int]) -> None:
    rows = out["results"]
    assert {(r["backend"], r["batch"]) for r in rows} == {(b, n) for b in backends for n in batches}
    for r in rows:
        assert ROW_KEYS <= r.keys()
        assert r["model"] == model
        assert r["xpnn_samples_per_s"] > 0
        assert len(r["xpnn_samples_per_s_all"]) == r["repeats"]
        if HAS_TORCH:
            assert r["torch_samples_per_s"] > 0
            assert r["ratio"] > 0 and len(r["ratios"]) == r["repeats"]
        else:
            assert r["ratio"] is None


@pytest.mark.mpi
def test_mlp_tiny_with_ranks_compare(tmp_path: Path) -> None:
    path = tmp_path / "tp.json"
    proc = run_script(
        "--model mlp --hidden 16 --backends numpy,numba,cupy --batches 8,32 --steps 3 "
        "--warmup 1 --repeats 2 --threads 1 --ranks-compare --ranks-samples 256 "
        "--ranks-batch 64 --ranks-repeats 1".split()
        + ["--json", str(path)]
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(path.read_text())
    assert out["benchmark"] == "throughput"
    assert out["config"]["threads"] == 1
    for info in out["workers"].values():  # each side ran in its own process with 1 thread
        assert info["threads"]["threads"] == 1 and info["pid"] > 0
    assert {"xpnn-numpy", "xpnn-numba"} <= out["workers"].keys()
    cupy_ran = "cupy" not in out["skipped"]
    if not cupy_ran:  # no GPU here: one line says why, the CPU rows still come
        assert any(line.startswith("cupy skipped: ") for line in proc.stdout.splitlines())
    check_rows(out, "mlp", ["numpy", "numba"] + (["cupy"] if cupy_ran else []), [8, 32])
    assert "xpnn/torch" in proc.stdout
    rc = out["ranks_compare"]
    if HAS_TORCH:
        assert rc["ranks"] == 2 and rc["xpnn_samples_per_s"] > 0 and rc["torch_samples_per_s"] > 0
        assert rc["ratio"] > 0
    else:
        assert rc is None and "ranks-compare skipped" in proc.stdout
    # the targets are for other configurations (threads=2, batch 128): listed as not measured
    assert all(t["pass"] is None for t in out["targets"])


def test_cnn_tiny(tmp_path: Path) -> None:
    path = tmp_path / "tp.json"
    proc = run_script(
        "--model cnn --backends numba --batches 4".split() + TINY + ["--json", str(path)]
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(path.read_text())
    check_rows(out, "cnn", ["numba"], [4])
    if HAS_TORCH:
        assert out["torch_threads"] == 2


def test_bad_flag_is_a_usage_error() -> None:
    proc = run_script(["--backends", "tensorflow"], timeout=30)
    assert proc.returncode == 2
    assert "backends" in proc.stderr


def _cupy_usable() -> bool:
    from xpnn.backends import gpu_unavailable_reason

    return gpu_unavailable_reason() is None


@pytest.mark.skipif(_cupy_usable(), reason="CuPy and a CUDA device work here: cupy rows run")
def test_no_runnable_backend_is_one_line_and_writes_nothing(tmp_path: Path) -> None:
    """Only unusable backends asked for: exit 2 with one line saying which and why, no JSON
    (an empty one would replace the committed results file by default)."""
    path = tmp_path / "tp.json"
    proc = run_script(["--backends", "cupy", "--json", str(path)], timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert "--backends: none can run here (cupy: " in line and "Traceback" not in line
    assert not path.exists()


def test_no_torch_flag(tmp_path: Path) -> None:
    path = tmp_path / "tp.json"
    proc = run_script(
        "--hidden 8 --backends numpy --batches 4 --no-torch".split() + TINY + ["--json", str(path)]
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(path.read_text())
    assert out["torch_skipped"] == "--no-torch" and out["torch"] is None
    (row,) = out["results"]
    assert row["xpnn_samples_per_s"] > 0 and row["ratio"] is None
    assert all(t["pass"] is None for t in out["targets"])


def _throughput_module(monkeypatch: pytest.MonkeyPatch):
    """bench/throughput.py as a module (it imports ``_common`` from its own folder, and its
    dataclasses look themselves up in ``sys.modules``)."""
    import sys

    from conftest import ROOT

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location(
        "throughput_under_test", ROOT / "bench/throughput.py"
    )
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


RANKS_ARGS = "--model mlp --hidden 16 --ranks-compare --ranks-samples 256 --ranks-batch 64".split()


@pytest.mark.mpi
def test_a_failed_ranks_compare_run_names_the_run_and_its_reason(monkeypatch, tmp_path):
    """The ``mpiexec -n 2 python -m xpnn`` run failing (here: rank 0 raises at its first step)
    was a RuntimeError carrying the whole of stderr; it is a RunFailed naming the command and
    ending with xpnn's own line."""
    mod = _throughput_module(monkeypatch)
    args = mod.build_parser().parse_args(RANKS_ARGS)
    monkeypatch.setenv("XPNN_FAIL_AT", "0:0")
    with pytest.raises(mod.RunFailed) as failed:
        mod.run_cli_ranks(args, 2, tmp_path)
    message = str(failed.value)
    assert message.startswith("run failed (exit ") and " -m xpnn " in message.splitlines()[0]
    assert "injected failure at step 0" in message


def test_a_failed_ranks_compare_ends_the_script_in_one_message(monkeypatch, capsys):
    """...and the script said it as a traceback; now as ``throughput: --ranks-compare: ...``,
    exit 1. (PyTorch's side is a stand-in: the xpnn run fails before it is asked anything.)"""
    mod = _throughput_module(monkeypatch)

    class StandInWorker:
        info: dict = {}

        def close(self) -> None:
            pass

    def failing(args, worker):
        raise mod.RunFailed("run failed (exit 1): mpiexec -n 2 ...\n  rank 0: it broke")

    monkeypatch.setattr(mod.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(mod, "start_torch_worker", lambda cfg, device: (StandInWorker(), None))
    monkeypatch.setattr(mod, "ranks_compare", failing)
    args = mod.build_parser().parse_args(RANKS_ARGS)
    assert mod.run(args, [], {}) == 1
    err = capsys.readouterr().err
    expected = "run failed (exit 1): mpiexec -n 2 ...\n  rank 0: it broke\n"
    assert err == "throughput: --ranks-compare: " + expected
