"""The CuPy backend computes what the NumPy backend computes, and trains under mpiexec;
``python -m bench step_phases`` times its steps.

Skipped, with the reason, where CuPy or a CUDA device is missing (as in CI).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import cupy_or_skip, run_xpnn

pytestmark = pytest.mark.gpu

cupy = cupy_or_skip()

from test_bench_step_phases import _phases  # noqa: E402

from xpnn.backends import get_backend  # noqa: E402
from xpnn.nn import Context, mlp  # noqa: E402
from xpnn.train.optim import Schedule, make_optimizer  # noqa: E402

TOL = {"float32": 1e-5, "float64": 1e-10}
# the multi-rank comparisons: 600 synthetic samples, global batch 70, 2 epochs in float64
SMALL_FLOAT64_RUN = [
    "--dataset", "synthetic", "--synthetic-size", "600", "--epochs", "2", "--batch-size", "70",
    "--dtype", "float64", "--no-progress",
]  # fmt: skip
LR = 0.01


def _atol(key, ref, dtype, optimizer):
    """The absolute slack next to ``rtol``: float32 sums taken in another order (cuBLAS
    against OpenBLAS) differ by rounding relative to the largest terms, not to a result that
    cancelled to near zero, so the slack is ``rtol`` times the array's scale. Adam divides by
    the gradient's own size, which turns that relative rounding of a near-zero gradient into
    an absolute change of the step: a thousandth of a step is allowed for it in float32, and
    the float32 Adam chain is compared for one step only (the next forward pass inherits that
    change); float64 compares three steps of every optimizer at 1e-10."""
    atol = TOL[dtype] * float(np.max(np.abs(ref)))
    if dtype == "float32" and optimizer == "adam" and key.startswith("params"):
        atol += 1e-3 * LR
    return atol


def _run(backend, act, optimizer, loss, steps=3):
    model = mlp((64, 32), act, loss=loss).build((1, 8, 8), backend, seed=1)
    opt = make_optimizer(optimizer, model.params, model.grads, backend.kernels, Schedule(LR))
    rng = np.random.default_rng(0)
    out = {}
    for step in range(steps):
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
    steps = 1 if (dtype, optimizer) == ("float32", "adam") else 3  # see _atol
    ref = _run(get_backend("numpy", dtype), act, optimizer, "softmax_cross_entropy", steps)
    got = _run(get_backend("cupy", dtype), act, optimizer, "softmax_cross_entropy", steps)
    assert len(ref) == 4 * steps
    for key in ref:
        np.testing.assert_allclose(
            got[key],
            ref[key],
            rtol=TOL[dtype],
            atol=_atol(key, ref[key], dtype, optimizer),
            err_msg=key,
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
    base = [*SMALL_FLOAT64_RUN, "--backend", "cupy", "--hidden", "32"]
    results = {}
    # The last run cuts mpi-host's gradients into 1 kB buckets: many allreduces in flight and
    # an update part by part as they complete, on device buffers staged through the host.
    runs = [
        ("mpi-host", []),
        ("mpi-cuda", []),
        ("nccl", []),
        ("mpi-host", ["--bucket-mb", "0.001"]),
    ]
    for k, (comm, extra) in enumerate(runs):
        saved, metrics = tmp_path / f"{k}.npz", tmp_path / f"{k}.jsonl"
        proc = run_xpnn(
            [*base, "--comm", comm, *extra, "--save", str(saved), "--metrics", str(metrics)],
            ranks=2,
        )
        assert proc.returncode == 0, proc.stderr
        used = json.loads(metrics.read_text().splitlines()[-1])["comm"]
        with np.load(saved) as data:
            results[f"{used} {' '.join(extra)}".strip()] = {k: data[k] for k in data.files}
    assert "mpi-host --bucket-mb 0.001" in results, list(results)
    ref = results["mpi-host"]
    for used, params in results.items():
        for name in ref:
            np.testing.assert_allclose(params[name], ref[name], rtol=1e-10, err_msg=used)


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam", "adamw"])
def test_cupy_update_of_a_gradient_in_parts_equals_numpy(optimizer):
    """An optimizer handed its gradient as a tuple of parts (``Kernels.sum_rows``) updates as
    NumPy does with the parts added up."""
    rng = np.random.default_rng(5)
    p0, g1, g2 = (rng.standard_normal(1000) for _ in range(3))
    out = {}
    for name in ("numpy", "cupy"):
        backend = get_backend(name, "float64")
        p, a, b = (backend.asarray(v.copy()) for v in (p0, g1, g2))
        grads = (a, b) if name == "cupy" else a + b
        opt = make_optimizer(optimizer, p, grads, backend.kernels, Schedule(LR))
        for _ in range(3):
            opt.step()
        out[name] = backend.to_host(p)
    np.testing.assert_allclose(out["cupy"], out["numpy"], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    ("parallel", "schedule", "ranks"),
    [
        ("tensor", None, 2),
        ("pipeline", "gpipe", 2),
        ("pipeline", "1f1b", 2),
        ("tensor", None, 4),  # 2 replicas x 2 ranks (--model-ranks 2): 2-D
        ("pipeline", "1f1b", 4),
    ],
)
def test_cupy_model_parallel_computes_the_one_rank_numpy_run(tmp_path, parallel, schedule, ranks):
    """Split layers (tensor) or stages (pipeline, both schedules) on device buffers:
    activations and input gradients are allreduced, or sent between stages, through whatever
    the communicator is here (host staging on one shared GPU); with 4 ranks, two replicas of
    2 ranks each also sum their gradients over the data group."""
    base = [*SMALL_FLOAT64_RUN, "--hidden", "48,40,24"]
    if schedule:
        base += ["--microbatches", "3", "--pipeline-schedule", schedule]
    grid = ["--model-ranks", "2"] if ranks == 4 else []
    saved = {}
    for n, extra in ((1, ["--backend", "numpy"]), (ranks, ["--backend", "cupy", *grid])):
        path = tmp_path / f"{n}.npz"
        args = [*base, *extra, "--parallel", parallel, "--save", str(path)]
        proc = run_xpnn(args, ranks=n)
        assert proc.returncode == 0, proc.stderr
        with np.load(path) as data:
            saved[n] = {k: data[k] for k in data.files}
    for name, ref in saved[1].items():
        scale = np.abs(ref).max()
        np.testing.assert_allclose(
            saved[ranks][name], ref, rtol=0, atol=1e-10 * scale, err_msg=name
        )


def test_a_cupy_pipeline_checkpoint_resumes_on_one_cupy_rank(tmp_path):
    """Checkpoints gather the stages from device buffers and restore into device buffers (the
    optimizer state too): 2 CuPy stages for epoch 1, then 1 CuPy rank for epoch 2, ≡ 1 NumPy
    rank throughout."""
    base = [*SMALL_FLOAT64_RUN, "--hidden", "48,40"]
    ref, out, ck = tmp_path / "ref.npz", tmp_path / "resumed.npz", tmp_path / "ck"
    proc = run_xpnn([*base, "--backend", "numpy", "--save", str(ref)])
    assert proc.returncode == 0, proc.stderr
    first = [*base, "--backend", "cupy", "--parallel", "pipeline", "--epochs", "1"]
    proc = run_xpnn([*first, "--checkpoint-dir", str(ck)], ranks=2)
    assert proc.returncode == 0, proc.stderr
    second = [*base, "--backend", "cupy", "--checkpoint-dir", str(ck), "--resume"]
    proc = run_xpnn([*second, "--save", str(out)])
    assert proc.returncode == 0, proc.stderr
    assert "resume:" in proc.stdout
    with np.load(ref) as want, np.load(out) as got:
        for name in want.files:
            scale = np.abs(want[name]).max()
            np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-10 * scale)


def test_step_phases_on_cupy_add_up():
    """Its timers synchronize the device on CuPy, so the phases hold the device's work."""
    (r,) = _phases(1, ("--backend", "cupy"))
    m = {k.removesuffix("_ms"): v["median"] for k, v in r["metrics"].items()}
    assert r["info"]["mean_ms"] > 0 and m["update"] > 0 and m["fences"] == 0
    assert 0 < m["forward"] < m["compute"] and 0 < m["wgrad"] < m["compute"]
    assert m["compute"] + m["update"] <= m["step"] * 1.5 + 0.01
