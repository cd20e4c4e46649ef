"""bench/staging.py: without a GPU it says why in one line and exits 0 (a bad size:
test_bench_usage.py). On a GPU, ci/gpu.sh runs it on 1 and 2 ranks."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT, mpiexec_path

SCRIPT = str(ROOT / "bench" / "staging.py")


def _has_cuda() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # ImportError, or no driver
        return False


@pytest.mark.skipif(_has_cuda(), reason="a CUDA device is present: the GPU path runs instead")
def test_without_a_gpu_it_skips_in_one_line():
    proc = subprocess.run(
        [sys.executable, SCRIPT], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") == 1 and proc.stdout.startswith("staging: skipped"), proc.stdout


@pytest.mark.mpi
@pytest.mark.skipif(_has_cuda(), reason="a CUDA device is present: the GPU path runs instead")
def test_without_a_gpu_two_ranks_say_it_once():
    """Rank 0 alone says it skipped, not every rank."""
    proc = subprocess.run(
        [mpiexec_path(), "-n", "2", sys.executable, SCRIPT],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") == 1 and proc.stdout.startswith("staging: skipped"), proc.stdout
