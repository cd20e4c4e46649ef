"""bench/within_job.py: two configurations built in one job, their epochs timed in turn."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import ROOT, mpiexec_path

pytestmark = pytest.mark.mpi

TINY = [
    "--dataset", "synthetic", "--synthetic-size", "256", "--hidden", "16",
    "--batch-size", "32", "--threads", "1",
]  # fmt: skip


def _run(tmp_path, ranks, a, b, rounds):
    out = tmp_path / "within.json"
    cmd = [sys.executable, str(ROOT / "bench" / "within_job.py"), "--a", a, "--b", b]
    cmd += ["--rounds", str(rounds), "--json", str(out), "--", *TINY]
    if ranks > 1:
        cmd = [mpiexec_path(), "-n", str(ranks), *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, json.loads(out.read_text())


def test_two_schemes_alternate_abba_on_two_ranks(tmp_path):
    stdout, got = _run(tmp_path, 2, "--comm mpi-shm", "--comm mpi-host", rounds=3)
    assert got["ranks"] == 2 and got["a"] == ["--comm", "mpi-shm"]
    assert [r["order"] for r in got["rounds"]] == ["BA", "AB", "BA"]
    for r in got["rounds"]:
        assert r["a_s"] > 0 and r["b_s"] > 0
        assert r["ratio"] == pytest.approx(r["a_s"] / r["b_s"])
    ratios = sorted(r["ratio"] for r in got["rounds"])
    assert got["median_ratio"] == pytest.approx(ratios[1])
    assert "A: --comm mpi-shm" in stdout and "B: --comm mpi-host" in stdout
    assert f"median ratio A / B {got['median_ratio']:.3f}" in stdout


def test_one_process_compares_two_optimizers(tmp_path):
    _, got = _run(tmp_path, 1, "--optimizer sgd", "", rounds=1)
    assert got["ranks"] == 1 and got["b"] == [] and len(got["rounds"]) == 1


def test_a_flag_that_has_no_effect_on_a_side_says_so(tmp_path):
    """``--b --recompute`` without a pipeline was timed silently as if it changed something."""
    out = tmp_path / "within.json"
    cmd = [sys.executable, str(ROOT / "bench" / "within_job.py"), "--a", "", "--b=--recompute"]
    cmd += ["--rounds", "1", "--json", str(out), "--", *TINY]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        "within_job.py: note: --b: --recompute has no effect without --parallel pipeline"
    ]


def test_a_failing_rank_stops_the_comparison():
    cmd = [mpiexec_path(), "-n", "2", sys.executable, str(ROOT / "bench" / "within_job.py")]
    cmd += ["--a", "--comm mpi-shm", "--b", "--comm mpi-host", "--rounds", "2", "--", *TINY]
    env = {**os.environ, "XPNN_FAIL_AT": "1:3"}
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert proc.returncode != 0 and time.monotonic() - start < 30
    assert "rank 1: RuntimeError: injected failure at step 3" in proc.stderr
    assert "Traceback" not in proc.stderr and "median" not in proc.stdout


def test_a_side_of_one_word_starting_with_dashes_is_its_value(tmp_path):
    """``--b --optimizer=momentum``: the word is side B's arguments, not a flag of this script
    (not argparse's "argument --b: expected one argument")."""
    _, got = _run(tmp_path, 1, "--optimizer=sgd", "--optimizer=momentum", rounds=1)
    assert got["a"] == ["--optimizer=sgd"] and got["b"] == ["--optimizer=momentum"]


@pytest.mark.parametrize(
    ("where", "flag", "needle"),
    [
        ("--a", ["--metrics", "m.jsonl"], "--a: --metrics: not used here"),
        ("--b", ["--checkpoint-dir", "ck"], "--b: --checkpoint-dir: not used here"),
        ("--", ["--save", "s.npz"], "--save (after --): not used here"),
    ],
)
def test_an_ignored_file_flag_is_refused_and_creates_nothing(tmp_path, where, flag, needle):
    """Flags that name files are refused, not ignored while an empty metrics file or
    checkpoint folder is left behind."""
    flag = [flag[0], str(tmp_path / flag[1])]
    cmd = [sys.executable, str(ROOT / "bench" / "within_job.py"), "--a", "--seed 1"]
    if where == "--":
        cmd += ["--", *TINY, *flag]
    else:
        cmd += [where, " ".join(flag), "--", *TINY]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"within_job.py: error: {needle}"), proc.stderr
    assert list(tmp_path.iterdir()) == []
