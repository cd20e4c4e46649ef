"""Hostile values given to ``python -m bench``: each is refused before anything is measured
or written, in one line on stderr naming the flag, exit 2; never a traceback, a folder made,
a device written or a run started with a value xpnn would refuse. Through the real command,
a subprocess each, as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

CASES = [
    (["polling", "--out", "/dev/full"], "--out /dev/full"),
    (["report", "--out", "/dev/full"], "--out /dev/full"),
    (["report", "--out", "bench/core.py"], "--out bench/core.py"),
    (["crossover", "--dtypes", "float8"], "--dtypes"),
    (["allreduce", "--comm", "bogus"], "--comm"),
    (["allreduce", "--max-size", "0"], "--max-size"),
    (["allreduce", "--max-size", "-5"], "--max-size"),
    (["scaling", "--samples", "-5"], "--samples"),
    (["scaling", "--epochs", "0"], "--epochs"),
    (["scaling", "--lr", "nan"], "--lr"),
    (["scaling", "--ranks", "1", "--activation", "bogus"], "--activation"),
    (["polling", "--ranks", "99999999999"], "--ranks"),
    (["crossover", "--out", "/nonexist-xpnn-bench/x.jsonl"], "/nonexist-xpnn-bench"),
    (["optimizer_step", "--params", "1500000000000"], "--params"),
    (["report", "--repeats", "0"], "--repeats"),
    (["batch_regimes", "--quiet-wait", "-1"], "--quiet-wait"),
]


def bench(args: list[str], cwd: Path = ROOT, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "bench", *args], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=timeout,
                          stdin=subprocess.DEVNULL)  # fmt: skip


@pytest.mark.parametrize(("args", "named"), CASES, ids=lambda v: " ".join(v)[:40])
def test_a_hostile_value_is_one_line_and_exit_2(args, named):
    proc = bench(args)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert named in line, line
    assert proc.stdout == ""  # nothing measured, nothing written
    assert not Path("/nonexist-xpnn-bench").exists()


def test_a_records_file_through_a_link_is_refused(tmp_path):
    target = tmp_path / "someone-elses.txt"
    target.write_text("theirs\n")
    (tmp_path / "r.jsonl").symlink_to(target)
    proc = bench(["crossover", "--out", str(tmp_path / "r.jsonl"), "--sizes", "8"])
    assert proc.returncode == 2 and "not a regular file" in proc.stderr, proc.stderr
    assert target.read_text() == "theirs\n"


NUMERIC = {  # flags whose value sets a size, a count or a rate of what is run
    "scaling": ["--samples", "--epochs", "--lr", "--ranks", "--repeats", "--threads"],
    "allreduce": ["--max-size", "--ranks", "--iters", "--repeats"],
    "polling": ["--ranks", "--iters", "--timeout"],
    "crossover": ["--sizes", "--repeats", "--sample-ms"],
    "optimizer_step": ["--params", "--rounds", "--calls"],
    "batch_regimes": ["--batches", "--lrs", "--target", "--max-steps", "--repeats"],
}
BAD = st.one_of(
    st.sampled_from(["0", "-5", "nan", "inf", "-inf", "1e308", "99999999999", "", "x", "1,,-2"]),
    st.integers(max_value=0).map(str),
    st.integers(min_value=10**11).map(str),
)


@settings(max_examples=12, deadline=None, derandomize=True, phases=[Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(pick=st.data(), value=BAD)
def test_any_bad_number_is_refused_before_measuring(tmp_path_factory, pick, value):
    name = pick.draw(st.sampled_from(sorted(NUMERIC)))
    flag = pick.draw(st.sampled_from(NUMERIC[name]))
    folder = tmp_path_factory.mktemp("bench")
    proc = bench([name, flag, value, "--out", str(folder / "r.jsonl")], timeout=30)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 2, (name, flag, value, proc.returncode, proc.stderr[-300:])
    (line,) = proc.stderr.strip().splitlines()
    assert flag in line, line
    assert not (folder / "r.jsonl").exists()
