"""The CuPy backend computes what the NumPy backend computes, and trains under mpiexec.

Skipped, with the reason, where CuPy or a CUDA device is missing (as in CI).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import run_xpnn

pytestmark = pytest.mark.gpu

try:
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 1:
        pytest.skip("no CUDA device", allow_module_level=True)
except Exception as exc:  # ImportError, or CUDARuntimeError without a driver
    pytest.skip(f"no usable CuPy/CUDA device: {exc}", allow_module_level=True)

from xpnn.backends import get_backend  # noqa: E402
from xpnn.nn import Context, mlp  # noqa: E402
from xpnn.optim import Schedule, make_optimizer  # noqa: E402

TOL = {"float32": 1e-5, "float64": 1e-10}


def _run(backend, act, optimizer, loss):
    model = mlp((64, 32), act, loss=loss).build((1, 8, 8), backend, seed=1)
    opt = make_optimizer(optimizer, model.params, model.grads, backend.kernels, Schedule(0.01))
    rng = np.random.default_rng(0)
    out = {}
    for step in range(3):
        x = backend.asarray(rng.random((32, 1, 8, 8)))
        y = backend.asarray(rng.integers(0, 10, 32), dtype=backend.xp.int64)
        out[f"logits{step}"] = backend.to_host(model.forward(x, Context(train=True)))
        loss_sum, _ = model.loss_and_grads(x, y, Context(train=True), 1 / 32)
        out[f"loss{step}"] = float(loss_sum)
        out[f"grads{step}"] = backend.to_host(model.grads).copy()
        opt.step()
        out[f"params{step}"] = backend.to_host(model.params).copy()
    return out


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("act", ["relu", "sigmoid", "tanh"])
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
def test_cupy_equals_numpy(dtype, act, optimizer):
    ref = _run(get_backend("numpy", dtype), act, optimizer, "softmax_cross_entropy")
    got = _run(get_backend("cupy", dtype), act, optimizer, "softmax_cross_entropy")
    for key in ref:
        np.testing.assert_allclose(
            got[key], ref[key], rtol=TOL[dtype], atol=TOL[dtype] * 1e-2, err_msg=key
        )


def test_cupy_sigmoid_bce_equals_numpy():
    ref = _run(get_backend("numpy", "float64"), "relu", "adam", "sigmoid_bce")
    got = _run(get_backend("cupy", "float64"), "relu", "adam", "sigmoid_bce")
    for key in ref:
        np.testing.assert_allclose(got[key], ref[key], rtol=1e-10, atol=1e-12, err_msg=key)


def test_two_rank_cupy_run_trains(tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = run_xpnn(
        [
            "--backend",
            "cupy",
            "--dataset",
            "synthetic",
            "--synthetic-size",
            "4000",
            "--epochs",
            "3",
            "--batch-size",
            "256",
            "--metrics",
            str(metrics),
            "--no-progress",
        ],
        ranks=2,
    )
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    epochs = [r for r in records if r["event"] == "epoch"]
    assert epochs[-1]["train_loss"] < epochs[0]["train_loss"]
    assert records[-1]["backend"] == "cupy" and records[-1]["ranks_agree"]
    assert records[-1]["test_acc"] > 0.5


def test_every_supported_comm_gives_the_same_parameters(tmp_path):
    """Each --comm that works here (others fall back, saying so) trains to the same numbers."""
    base = [
        "--backend",
        "cupy",
        "--dataset",
        "synthetic",
        "--synthetic-size",
        "600",
        "--hidden",
        "32",
        "--epochs",
        "2",
        "--batch-size",
        "70",
        "--dtype",
        "float64",
        "--no-progress",
    ]
    results = {}
    for comm in ("mpi-host", "mpi-cuda", "nccl"):
        saved, metrics = tmp_path / f"{comm}.npz", tmp_path / f"{comm}.jsonl"
        proc = run_xpnn(
            [*base, "--comm", comm, "--save", str(saved), "--metrics", str(metrics)], ranks=2
        )
        assert proc.returncode == 0, proc.stderr
        used = json.loads(metrics.read_text().splitlines()[-1])["comm"]
        with np.load(saved) as data:
            results[used] = {k: data[k] for k in data.files}
    ref = results["mpi-host"]
    for used, params in results.items():
        for name in ref:
            np.testing.assert_allclose(params[name], ref[name], rtol=1e-10, err_msg=used)
