"""bench/pipeline_memory.py runs real ``mpiexec -n 2`` pipelines (GPipe and 1F1B, with and
without ``--recompute``) on a tiny MLP and writes its table, JSON and plot. Memory and speed are
never compared: a tiny model's activations are lost in the interpreter's own footprint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_bench

pytestmark = pytest.mark.mpi

TINY = [
    "--model", "mlp", "--hidden", "16,8", "--synthetic-size", "128", "--batch-size", "64",
    "--microbatches", "4", "--epochs", "2", "--repeats", "1", "--backend", "numpy",
]  # fmt: skip


def test_four_configurations_tiny(tmp_path: Path) -> None:
    proc = run_bench("pipeline_memory.py", [*TINY, "--out", str(tmp_path)], timeout=120)
    assert proc.returncode == 0, proc.stderr

    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("schedule"))
    assert "stage 0 MiB" in lines[header] and "stage 1 MiB" in lines[header]
    assert "stage 2 MiB" not in lines[header] and "last-epoch s" in lines[header]
    rows = []
    for line in lines[header + 2 :]:
        if not line.strip():
            break
        rows.append(line.split()[:2])
    assert rows == [["gpipe", "no"], ["gpipe", "yes"], ["1f1b", "no"], ["1f1b", "yes"]]
    assert sum(line.startswith(("gpipe: --recompute", "1f1b: --recompute")) for line in lines) == 2

    out = json.loads((tmp_path / "pipeline_memory.json").read_text())
    summary = out["summary"]
    assert len(summary) == 4
    for e in summary:
        assert len(e["stage_mib"]) == 2
        assert all(v > 0 for v in e["stage_mib"])
        assert e["last_epoch_s"] > 0
    assert {(e["schedule"], e["recompute"]) for e in summary} == {
        ("gpipe", False), ("gpipe", True), ("1f1b", False), ("1f1b", True)
    }  # fmt: skip
    assert [s["schedule"] for s in out["recompute_savings"]] == ["gpipe", "1f1b"]
    assert all(s["memory_ratio"] > 0 for s in out["recompute_savings"])

    # what the runs themselves reported (read back from their metrics), not what was asked
    results = [r for cfg in out["runs"] for r in cfg["results"]]
    assert len(results) == 4
    assert sorted(r["schedule"] for r in results) == ["1f1b", "1f1b", "gpipe", "gpipe"]
    assert sum(r["recompute"] is True for r in results) == 2
    for r in results:
        assert ("--recompute" in r["command"]) == r["recompute"]
        assert r["command"][r["command"].index("-n") + 1] == "2"
        assert r["microbatches"] == 4
        assert len(r["peak_rss_mb"]) == 2 and all(v > 0 for v in r["peak_rss_mb"])
        assert len(r["epoch_seconds"]) == 2 and r["last_epoch_s"] == r["epoch_seconds"][-1]

    png = (tmp_path / "pipeline_memory.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000


def test_a_failing_run_prints_its_command_and_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XPNN_FAIL_AT", "1:1")  # each run's stage 1 raises at its second step
    proc = run_bench("pipeline_memory.py", [*TINY, "--out", str(tmp_path)], timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "run failed" in proc.stderr and "-m xpnn --parallel pipeline" in proc.stderr
    assert "injected failure at step 1" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "pipeline_memory.json").exists()


def test_more_stages_than_layers_are_refused_before_any_run(tmp_path: Path) -> None:
    """An MLP 784-8-10 has 2 layers with parameters: xpnn refuses 3 stages, and so does the
    script, by xpnn's rule, before it starts mpiexec (before the 18th session, the first run
    failed on it: "run failed (exit 2): <command>", exit 1)."""
    args = [*TINY, "--hidden", "8", "--stages", "3", "--out", str(tmp_path / "out")]
    proc = run_bench("pipeline_memory.py", args, timeout=60)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("bench/pipeline_memory.py: error: --stages 3: --parallel pipeline: ")
    assert "only 2 layers with parameters" in line
    assert list(tmp_path.iterdir()) == []
