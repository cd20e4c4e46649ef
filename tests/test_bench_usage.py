"""Every benchmark refuses a bad argument before it measures anything: exit 2, one line
naming the flag, no traceback (as the xpnn command does)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT


@pytest.mark.parametrize(
    ("script", "args", "needle"),
    [
        ("matmul_crossover", ["--min-n", "0"], "--min-n: must be >= 1"),
        ("matmul_crossover", ["--min-n", "512", "--max-n", "64"], "--min-n 512 is above --max-n"),
        ("matmul_crossover", ["--threads", "0"], "--threads: must be >= 1"),
        ("matmul_crossover", ["--repeats", "0"], "--repeats: must be >= 1"),
        ("matmul_crossover", ["--warmup", "-1"], "--warmup: must be >= 0"),
        ("matmul_crossover", ["--shapes", "2x2"], "--shapes: bad shape '2x2'"),
        ("allreduce", ["--iters", "0"], "--iters: must be >= 1"),
        ("allreduce", ["--max-size", "2"], "--max-size must be at least 4 bytes"),
        ("optimizer_step", ["--params", "0"], "--params: must be >= 1"),
        ("scaling", ["--ranks", "0"], "--ranks"),
        ("throughput", ["--steps", "0"], "--steps: must be >= 1"),
        ("staging", ["--sizes", "4,-1"], "--sizes"),
        ("pipeline_memory", ["--stages", "1"], "--stages"),
    ],
)
def test_a_bad_argument_is_a_one_line_usage_error(script, args, needle):
    path = ROOT / "bench" / f"{script}.py"
    proc = subprocess.run(
        [sys.executable, str(path), *args], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert needle in last, proc.stderr
    assert proc.stdout == ""  # nothing measured, nothing reported
