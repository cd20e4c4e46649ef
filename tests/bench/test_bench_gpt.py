"""``python -m bench gpt``: the GPT's tokens/s, peak memory and counted bytes per step in each
mode, beside a native torch.nn GPT of the same architecture."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import run_bench

from bench.core import read_records

SMALL = ["--quick", "--repeats", "1"]


def write_text(path) -> str:
    rng = np.random.default_rng(0)
    words = ["to", "be", "or", "not", "the", "king", "queen", "shall", "my", "lord"]
    path.write_text(" ".join(rng.choice(words, 3000)) + "\n", encoding="utf-8")
    return str(path)


def test_every_mode_counts_its_bytes_and_memory(tmp_path):
    out = tmp_path / "g.jsonl"
    text = write_text(tmp_path / "t.txt")
    modes = "one,batch-threads,data,tensor,pipeline"
    proc = run_bench("gpt", *SMALL, "--text", text, "--modes", modes, "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    rs = {r["config"]["mode"]: r for r in read_records(out, "gpt")}
    assert list(rs) == modes.split(",")
    sent = {m: r["metrics"]["comm_bytes_per_step"]["median"] for m, r in rs.items()}
    assert sent["one"] == sent["batch-threads"] == 0
    assert min(sent["data"], sent["tensor"], sent["pipeline"]) > 0
    # tensor parallelism sends activations every sublayer: more than the data mode's gradients
    # of this small model
    assert sent["tensor"] > sent["data"]
    for r in rs.values():
        assert r["metrics"]["tokens_per_s"]["median"] > 0
        assert r["metrics"]["peak_rss_mb"]["median"] > 10
    assert "mpiexec -n 2" in rs["tensor"]["config"]["command"]
    assert "--batch-threads 2" in rs["batch-threads"]["config"]["command"]
    assert "| tensor | 2 |" in proc.stdout


def test_the_torch_gpt_has_the_xpnn_gpt_parameter_count(tmp_path):
    pytest.importorskip("torch")  # an optional comparison: torch is no dependency of xpnn
    from bench.benchmarks._gpt_torch import build

    assert sum(p.numel() for p in build(65, 4, 4, 128, 64).parameters()) == 818_241
    out = tmp_path / "g.jsonl"
    text = write_text(tmp_path / "t.txt")
    proc = run_bench("gpt", *SMALL, "--text", text, "--modes", "torch", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    (r,) = read_records(out, "gpt")
    assert r["metrics"]["tokens_per_s"]["median"] > 0
