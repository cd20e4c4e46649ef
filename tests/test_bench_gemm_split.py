"""bench/gemm_split.py times one step's products at the global batch and at a rank's share.
The times are not checked; the table's shape and arithmetic are."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT


def test_every_product_of_the_step_is_timed_at_both_batches():
    args = ["--inputs", "6", "--hidden", "8", "--classes", "3", "--batch", "5", "--ranks", "2"]
    args += ["--samples", "2", "--seconds", "0"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gemm_split.py"), *args],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "B = 5 and at one rank's share B = 3 (2 ranks)" in lines[0]  # the larger share
    body = [line for line in lines[3:] if line.strip() and not line.startswith("ideal")]
    names = [line[:19].strip() for line in body]
    assert names == [
        "layer 0 forward", "layer 0 weight grad",  # no input gradient for the data
        "layer 1 forward", "layer 1 weight grad", "layer 1 input grad", "all",
    ]  # fmt: skip
    whole, part, ratio = zip(*[map(float, line.split()[-3:]) for line in body], strict=True)
    assert abs(whole[-1] - sum(whole[:-1])) <= len(whole)  # rounded to whole microseconds
    assert abs(part[-1] - sum(part[:-1])) <= len(part)
    assert all(r > 0 for r in ratio)
    assert lines[-1].startswith("ideal ratio 0.500; the products alone allow a speedup")
