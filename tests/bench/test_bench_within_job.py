"""``python -m bench within_job``: two configurations built in one job, their epochs timed in
turn, one record per job; the sides' xpnn flags checked before the job starts."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from conftest import run_bench
from test_bench_suite import assert_schema

from bench.core import read_records

pytestmark = pytest.mark.mpi

TINY = [
    "--dataset", "synthetic", "--synthetic-size", "256", "--hidden", "16",
    "--batch-size", "32", "--threads", "1",
]  # fmt: skip


def bench(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_bench("within_job", *args, timeout=120, env=env)


def test_two_schemes_alternate_abba_on_two_ranks(tmp_path):
    out = tmp_path / "w.jsonl"
    proc = bench("--a", "--comm mpi-shm", "--b", "--comm mpi-host", "--rounds", "3",
                 "--out", str(out), "--", *TINY)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (r,) = read_records(out, "within_job")
    assert_schema(r, "within_job")
    c, m = r["config"], r["metrics"]
    assert c == {"a": ["--comm", "mpi-shm"], "b": ["--comm", "mpi-host"], "common": TINY,
                 "ranks": 2}  # fmt: skip
    assert r["info"]["orders"] == ["BA", "AB", "BA"] and r["repeats"] == 3
    assert m["a_s"]["median"] > 0 and m["b_s"]["median"] > 0
    pairs = zip(m["a_s"]["samples"], m["b_s"]["samples"], strict=True)
    assert m["a_over_b"]["samples"] == [a / b for a, b in pairs]
    assert f"median A / B {m['a_over_b']['median']:.3f}" in proc.stdout
    assert "| --comm mpi-shm | --comm mpi-host |" in proc.stdout


def test_one_process_compares_two_optimizers_given_as_one_word_each(tmp_path):
    """``--a=--optimizer=sgd``: the word is side A's flags, not a flag of the suite's."""
    out = tmp_path / "w.jsonl"
    proc = bench("--ranks", "1", "--a=--optimizer=sgd", "--b=--optimizer=momentum",
                 "--rounds", "1", "--out", str(out), "--", *TINY)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (r,) = read_records(out, "within_job")
    assert r["config"]["ranks"] == 1 and r["info"]["orders"] == ["BA"]
    assert r["config"]["a"] == ["--optimizer=sgd"] and r["config"]["b"] == ["--optimizer=momentum"]


def test_a_flag_that_has_no_effect_on_a_side_says_so(tmp_path):
    """``--b --recompute`` without a pipeline is timed, with the note python -m xpnn gives."""
    out = tmp_path / "w.jsonl"
    proc = bench("--ranks", "1", "--b=--recompute", "--rounds", "1", "--out", str(out), "--", *TINY)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        "bench: note: --b: --recompute has no effect without --parallel pipeline"
    ]
    (r,) = read_records(out, "within_job")
    assert r["info"]["notes"]["b"] == ["--recompute has no effect without --parallel pipeline"]


def test_a_failing_rank_stops_the_comparison(tmp_path):
    env = {**os.environ, "XPNN_FAIL_AT": "1:3"}
    out = tmp_path / "w.jsonl"
    start = time.monotonic()
    proc = bench("--a", "--comm mpi-shm", "--b", "--comm mpi-host", "--rounds", "2",
                 "--out", str(out), "--", *TINY, env=env)  # fmt: skip
    assert proc.returncode == 1 and time.monotonic() - start < 60, proc.stderr
    assert "rank 1: RuntimeError: injected failure at step 3" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == "" and not out.exists()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        # each side's xpnn flags are checked as xpnn checks them
        (["--a", "--epochs x"], "--a: --epochs: not an integer: 'x'"),
        (["--a", "--seed 1", "--", "--epochs", "x"], "--epochs: not an integer: 'x' (after --)"),
        (["--b", "'unclosed"], "--b: No closing quotation"),
        (["--rounds", "0"], "--rounds: must be >= 1"),
        (["--ranks", "0"], "--ranks: must be >= 1"),
        (["--a", "--seed 1", "--b", "--seed 1"], "--a and --b give the same arguments"),
        (["--a", "--dataset mnist --data-dir /nonexistent"], "--a: --data-dir /nonexistent: no"),
        # only training steps are timed: xpnn flags it would ignore are refused
        (["--a", "--epochs 3"], "--a: --epochs: not used here, --rounds sets"),
        (["--b", "--save /tmp/w.npz"], "--b: --save: not used here"),
        (["--a=--resume"], "--a: --resume: not used here"),
        (["--a", "--seed 1", "--", "--epochs", "3"], "--epochs (after --): not used here"),
        # a side's one word starting with -- needs the = form
        (["--b", "--resume"], "--b: expected one argument"),
    ],
)
def test_a_bad_flag_is_one_line_before_the_job_starts(tmp_path, args, needle):
    proc = bench("--out", str(tmp_path / "w.jsonl"), *args)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"bench: {needle}"), line
    assert list(tmp_path.iterdir()) == []


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
    args = ["--a", "--seed 1", "--out", str(tmp_path / "w.jsonl")]
    if where == "--":
        args += ["--", *TINY, *flag]
    else:
        args += [where, " ".join(flag), "--", *TINY]
    proc = bench(*args)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"bench: {needle}"), proc.stderr
    assert list(tmp_path.iterdir()) == []
