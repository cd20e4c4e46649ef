"""``python -m bench limit --batch-threads K``: the whole step of a process running K twins,
against the products of one thread's part of the batch (every part's in CPU time)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from conftest import ROOT

from bench.core import read_records


def limit(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "bench", "limit", "--quick", "--models", "gpt", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)


@pytest.mark.parametrize("clock", ["wall", "cpu"])
def test_the_products_are_one_parts_in_wall_time_and_every_parts_in_cpu_time(tmp_path, clock):
    out = tmp_path / "l.jsonl"
    flags = ["--backends", "numpy", "--threads", "2", "--batch-threads", "2", "--gpt-batch", "4"]
    proc = limit(*flags, "--repeats", "2", "--clock", clock, "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    (r,) = read_records(out, "limit")
    info = r["info"]
    assert r["config"]["batch_threads"] == info["batch_threads"] == 2 and r["repeats"] == 2
    assert set(info["phase_gemm"]) == {"forward", "wgrad", "igrad"}
    assert all(ms > 0 for ms in info["phase_gemm"].values())
    assert math.isclose(info["products_ms"], sum(info["phase_gemm"].values()), rel_tol=1e-9)
    # 2 sequences a part: the quick GPT's products (its first layer has no input gradient)
    embed, block, vocab = 16, 8, 65
    rows = 2 * block
    dense = [(embed, 3 * embed), (embed, embed), (embed, 4 * embed), (4 * embed, embed)]
    flop = sum(3 * 2 * rows * a * b for a, b in dense) + 3 * 2 * rows * embed * vocab
    heads, hd = 2, embed // 2
    flop += 6 * 2 * (2 * heads) * block * block * hd  # the attention's six batched products
    parts = 2 if clock == "cpu" else 1
    assert math.isclose(info["gflop"], parts * flop * 1e-9, rel_tol=1e-9)
    assert "2 (2 batch)" in proc.stdout and "2 batch threads" in proc.stdout


def test_batch_threads_that_do_not_divide_the_threads_are_one_line():
    proc = limit("--threads", "3", "--batch-threads", "2")
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "--batch-threads 2" in line and "--threads 3" in line
