"""The trainer's own measurements."""

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, run_xpnn

# A process started from this one (fork and exec, as a launcher does): its peak must be its
# own, not this big test process's (which ``getrusage`` would report).
PEAKS = """
import json
import numpy as np
from xpnn.runtime import peak_rss_mb
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


WIDTHS = [784, 16, 12, 8, 10]  # --hidden 16,12,8: two pairs of Dense layers under tensor
BATCH, STEPS = 40, 3  # 120 samples: every step the same global batch


def shape_bytes(parallel: str, comm: str) -> int:
    """Bytes 2 ranks together hand to MPI per float32 step, from the layer shapes alone."""
    if comm == "mpi-shm":  # the ranks of one node share the update in memory: nothing sent
        return 0
    if parallel == "data":  # every rank allreduces every gradient once
        params = sum(a * b + b for a, b in zip(WIDTHS, WIDTHS[1:], strict=False))
        return 2 * params * 4
    if parallel == "tensor":  # per rank: each row layer's output forward, each column
        rows = BATCH * (WIDTHS[2] + WIDTHS[4])  # layer's input gradient backward but the
        return 2 * (rows + BATCH * WIDTHS[2]) * 4  # first's (no gradient for the data)
    # one cut, after the first Dense (it holds most of the work): its activations forward,
    # their gradients back, every sample once each way
    return 2 * BATCH * WIDTHS[1] * 4


@pytest.mark.mpi
@pytest.mark.parametrize(
    "parallel, comm",
    [("data", "mpi-host"), ("data", "mpi-shm"), ("tensor", "mpi-host"), ("pipeline", "mpi-host")],
)
def test_counted_bytes_per_step_follow_the_shapes(tmp_path, parallel, comm):
    """The metrics' byte counts, from a real 2-rank run, against the shapes: a communication
    left uncounted, or counted twice, changes them."""
    metrics = tmp_path / "m.jsonl"
    args = ["--dataset", "synthetic", "--synthetic-size", str(BATCH * STEPS), "--epochs", "2"]
    args += ["--batch-size", str(BATCH), "--hidden", "16,12,8", "--optimizer", "sgd"]
    args += ["--parallel", parallel, "--comm", comm]
    args += ["--microbatches", "2"] if parallel == "pipeline" else []
    args += ["--threads", "1", "--no-progress", "--metrics", str(metrics)]
    proc = run_xpnn(args, ranks=2, timeout=120)
    assert proc.returncode == 0, proc.stderr
    epochs = [json.loads(line) for line in metrics.read_text().splitlines()][:-1]
    want = shape_bytes(parallel, comm)
    group = "data_comm_bytes" if parallel == "data" else "model_comm_bytes"
    other = "model_comm_bytes" if parallel == "data" else "data_comm_bytes"
    for e in epochs:
        assert e["comm"] == comm and e["comm_bytes_per_step"] == want
        assert e["comm_bytes"] == e[group] == STEPS * want and e[other] == 0
    assert len(epochs) == 2
