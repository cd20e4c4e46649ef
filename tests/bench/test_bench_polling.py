"""The polling benchmark: every way of waiting for one allreduce, timed at every size, on real
``mpiexec`` ranks, one record each; the table puts the ways side by side."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT

from bench.benchmarks import polling
from bench.core import read_records

pytestmark = pytest.mark.mpi


def test_every_way_at_every_size_becomes_a_record(tmp_path):
    out = tmp_path / "p.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "polling", "--sizes", "64,65536", "--iters", "2",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rs = read_records(out, "polling")
    got = {(r["config"]["size_bytes"], r["config"]["method"]) for r in rs}
    assert got == {(s, m) for s in (64, 65536) for m in polling.METHODS}
    assert all(r["config"]["ranks"] == 2 and r["metrics"]["latency_us"]["median"] > 0 for r in rs)
    head = polling.table(rs).splitlines()[0]
    assert head.startswith("| bytes | blocking µs |") and "xpnn µs" in head
