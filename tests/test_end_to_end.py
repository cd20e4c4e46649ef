"""End to end on real Fashion-MNIST (Debian's dataset-fashion-mnist; CI installs it)."""

import json

import pytest
from conftest import run_xpnn


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_mlp_reaches_86_percent_on_fashion_mnist(backend, fashion_dir, tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = run_xpnn(
        [
            "--backend",
            backend,
            "--dataset",
            "fashion-mnist",
            "--data-dir",
            str(fashion_dir),
            "--model",
            "mlp",
            "--hidden",
            "512,256",
            "--activation",
            "relu",
            "--optimizer",
            "adam",
            "--lr",
            "1e-3",
            "--batch-size",
            "128",
            "--epochs",
            "3",
            "--metrics",
            str(metrics),
            "--no-progress",
        ],
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr
    done = json.loads(metrics.read_text().splitlines()[-1])
    assert done["event"] == "done" and done["params"] == 535818
    assert done["test_acc"] >= 0.86, done
