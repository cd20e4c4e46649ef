"""``python -m bench trace_cost``: tracing off and on alternated under real ``mpiexec``, and the
per-span costs that say what share of a step tracing takes."""

from __future__ import annotations

import json

import pytest
from conftest import run_bench

pytestmark = pytest.mark.mpi


def test_trace_cost_records_both_ways_and_the_cost_per_span(tmp_path):
    out = tmp_path / "tc.jsonl"
    proc = run_bench("trace_cost", "--quick", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    records = {r["config"]["trace"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(records) == {"off", "on"}
    assert len(records["on"]["metrics"]["epoch_s"]["samples"]) == 2  # --quick: 2 of each
    assert records["on"]["metrics"]["spans_per_step"]["median"] > 5
    off = records["off"]["metrics"]
    assert 0 < off["span_off_ns"]["median"] < off["span_on_ns"]["median"]
    assert "A traced step recorded" in proc.stdout and "% of a step of" in proc.stdout
