"""The trainer's own measurements."""

import json
import subprocess
import sys

import numpy as np
from conftest import ROOT

# A process started from this one (fork and exec, as a launcher does): its peak must be its
# own, not this big test process's (which ``getrusage`` would report).
PEAKS = """
import json
import numpy as np
from xpnn.train import peak_rss_mb
before = peak_rss_mb()
block = np.ones(200 * 2**20 // 8)  # 200 MiB, every page written
print(json.dumps([before, peak_rss_mb()]))
"""


def test_peak_rss_is_in_mib_and_sees_a_new_high_water_mark():
    parent = np.ones(500 * 2**20 // 8)  # this process now peaks above 500 MiB
    out = subprocess.run(
        [sys.executable, "-c", PEAKS], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    del parent
    assert out.returncode == 0, out.stderr
    before, after = json.loads(out.stdout)
    assert 10 < before < 300  # a Python with NumPy: tens of MiB; not KiB, not the parent's peak
    assert 190 < after - before < 260


def test_the_epoch_loss_is_summed_in_float64(tmp_path):
    """An untrained network (lr 1e-300) over 3,750 float32 steps: NumPy's per-batch losses
    (float32 scalars) and Numba's (float64) must add up alike. A float32 running sum drifted
    by 4e-6 relative here."""
    losses = []
    for backend in ("numpy", "numba"):
        metrics = tmp_path / f"{backend}.jsonl"
        args = ["--dataset", "synthetic", "--synthetic-size", "6000", "--replicate", "20"]
        args += ["--batch-size", "32", "--epochs", "1", "--lr", "1e-300", "--hidden", "16"]
        args += ["--no-progress", "--backend", backend, "--metrics", str(metrics)]
        proc = subprocess.run(
            [sys.executable, "-m", "xpnn", *args], capture_output=True, text=True, cwd=ROOT
        )
        assert proc.returncode == 0, proc.stderr
        losses.append(json.loads(metrics.read_text().splitlines()[0])["train_loss"])
    assert abs(losses[0] - losses[1]) <= 1e-7 * abs(losses[1])


def test_any_warmup_asked_for_is_at_least_one_step():
    from xpnn.train import warmup_steps

    assert warmup_steps(0.5, 1) == 1  # half an epoch of full-batch steps: not none
    assert warmup_steps(0.0, 100) == 0
    assert warmup_steps(2.5, 10) == 25
