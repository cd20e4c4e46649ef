"""The 690,590-parameter CNN: data-parallel equivalence with dropout on, and real training."""

import json

import numpy as np
import pytest
from conftest import CNN_DROPOUT_RUN, run_xpnn, train_and_load


def test_cnn_one_rank_equals_two_ranks_with_dropout(tmp_path):
    saved = {}
    for ranks in (1, 2):
        saved[ranks], records, _ = train_and_load(tmp_path, ranks, CNN_DROPOUT_RUN)
        assert records[-1]["params"] == 690590 and records[-1]["ranks_agree"]
    assert len(saved[1]) == 12  # 3 convolutions + 3 dense layers, W and b each
    for name, value in saved[1].items():
        np.testing.assert_allclose(saved[2][name], value, rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.slow
def test_cnn_one_epoch_two_ranks_fashion_mnist(fashion_dir, tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = run_xpnn(
        [
            "--model",
            "cnn",
            "--dataset",
            "fashion-mnist",
            "--data-dir",
            str(fashion_dir),
            "--backend",
            "numba",
            "--epochs",
            "1",
            "--batch-size",
            "128",
            "--optimizer",
            "adam",
            "--lr",
            "1e-3",
            "--metrics",
            str(metrics),
            "--no-progress",
        ],
        ranks=2,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr
    done = json.loads(metrics.read_text().splitlines()[-1])
    assert done["params"] == 690590 and done["world_size"] == 2
    assert done["test_acc"] >= 0.80, done
