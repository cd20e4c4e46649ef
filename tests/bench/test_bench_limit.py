"""``python -m bench limit``: a record per (model, backend, threads) whose layers, phases and
products add up, and the tables that show them."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from conftest import ROOT

from bench.benchmarks import limit
from bench.core import read_records


def test_quick_run_records_layers_phases_and_products_that_add_up(tmp_path):
    out = tmp_path / "l.jsonl"
    cmd = [sys.executable, "-m", "bench", "limit", "--quick", "--backends", "numpy"]
    cmd += ["--threads", "1", "--repeats", "1", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    rs = read_records(out, "limit")
    assert [r["config"]["model"] for r in rs] == ["mlp", "cnn", "gpt"]
    for r in rs:
        info, layers = r["info"], r["info"]["layers"]
        assert r["repeats"] == 1 and (r["config"]["backend"], r["config"]["threads"]) == (
            "numpy",
            1,
        )
        assert set(info["phases"]) == set(limit.PHASES) == set(info["phase_gemm"])
        for p in ("forward", "wgrad", "igrad"):  # the phases are the layers' sums
            assert math.isclose(info["phases"][p], sum(row[p] for row in layers), rel_tol=1e-9)
            gemm = sum(row[f"{p}_gemm"] for row in layers)
            assert math.isclose(info["phase_gemm"][p], gemm, rel_tol=1e-9)
            assert gemm > 0  # every model has products in every phase
        assert math.isclose(info["products_ms"], sum(info["phase_gemm"].values()), rel_tol=1e-9)
        # one step: the phases are its parts, timed back to back
        step = r["metrics"]["step_ms"]["median"]
        assert math.isclose(sum(info["phases"].values()), step, rel_tol=1e-6)
        assert info["gflop"] > 0 and all(row["gflop"] >= 0 for row in layers)
    text = proc.stdout
    assert "| total of the layers |" in text and "| step (measured) |" in text
    assert "| model | backend | threads | step ms | GEMM ms | GFLOP | x GEMM |" in text
    assert "Conv2D(32, 3x3, relu)" in text and "TransformerBlock(16, 2 heads)" in text


def test_the_cnns_products_are_its_im2col_gemms():
    """The first convolution's input gradient is never asked: no product for it."""
    import numpy as np

    from xpnn.backends import get_backend
    from xpnn.nn import Context
    from xpnn.nn.models import cnn

    model = cnn().build((1, 28, 28), get_backend("numpy", "float32"), 0)
    x = np.random.default_rng(0).random((2, 1, 28, 28), dtype=np.float32)
    for layer in model.layers:
        x = layer.forward(x, Context())
    first = limit.products(model.layers[0], 2, True)
    assert first == [("forward", 1, 32, 9, 2 * 26 * 26, 0, 0), ("wgrad", 1, 32, 2 * 676, 9, 0, 1)]
    second = limit.products(model.layers[2], 2, False)
    assert second[0] == ("forward", 1, 128, 288, 200, 0, 0)  # 10x10 of 11x11: what the pool reads
    assert [s[0] for s in second] == ["forward", "wgrad", "igrad"]


@pytest.mark.parametrize("flag", ["--models", "--backends"])
def test_an_unknown_name_is_one_line(flag):
    cmd = [sys.executable, "-m", "bench", "limit", flag, "nope"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert flag in line
