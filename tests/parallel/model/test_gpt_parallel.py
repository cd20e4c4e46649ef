"""The GPT under data, tensor (heads split) and pipeline (blocks staged) parallelism: each
equals one rank in float64, under real mpiexec, and tensor splits cut whole heads."""

from pathlib import Path

import numpy as np
import pytest
from conftest import assert_one_line_user_error, run_xpnn, train_and_load

from xpnn.backends import get_backend
from xpnn.nn import gpt
from xpnn.parallel.model.tensor import ColumnDense, RowDense, split_layers
from xpnn.parallel.model.whole import whole_size


def write_text(path) -> str:
    """A few thousand characters of seeded words: a small vocabulary with structure."""
    rng = np.random.default_rng(0)
    words = ["to", "be", "or", "not", "the", "king", "queen", "shall", "my", "lord"]
    text = " ".join(rng.choice(words, 900)) + "\n"
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """One corpus file for the module: the 1-rank runs of the same arguments are then trained
    once (conftest.train_and_load) for every layout compared against them."""
    return write_text(tmp_path_factory.mktemp("gpt") / "corpus.txt")


def gpt_args(corpus: str) -> list[str]:
    return [
        "--model", "gpt", "--dataset", "text", "--data-dir", corpus, "--layers", "2",
        "--heads", "2", "--embed", "8", "--block", "6", "--batch-size", "4000", "--epochs", "1",
        "--dtype", "float64", "--lr", "0.01", "--warmup-steps", "0", "--threads", "1",
        "--no-progress", "--backend", "numpy",
    ]  # fmt: skip


def test_tensor_split_keeps_whole_heads_of_the_one_rank_weights():
    backend = get_backend("numpy", "float64")
    full = gpt(7, layers=1, heads=2, embed=8, block=4).build((4,), backend, 3).named_params()
    parts = []
    for rank in range(2):
        model = gpt(7, layers=1, heads=2, embed=8, block=4)
        split_layers(model.layers, rank, 2)
        attn = model.layers[2].children["attn"].children["sa"]
        assert isinstance(attn.children["qkv"], ColumnDense)
        assert isinstance(attn.children["proj"], RowDense)
        model.build((4,), backend, 3)
        parts.append(model.named_params())
        assert whole_size(model) == sum(p.size for p in full.values())
    qkv = "layer2.attn.sa.qkv.W"
    assert parts[0][qkv].shape == (8, 12)  # one head: its 4 query, key and value columns
    np.testing.assert_array_equal(np.hstack([p[qkv] for p in parts]), full[qkv])
    for name in ("layer2.attn.sa.proj.W", "layer2.mlp.ff.down.W"):
        np.testing.assert_array_equal(np.vstack([p[name] for p in parts]), full[name])
    for name in ("layer0.W", "layer2.attn.ln.gamma", "layer2.attn.sa.proj.b", "layer4.W"):
        np.testing.assert_array_equal(parts[1][name], full[name])  # replicated


@pytest.mark.parametrize(
    "ranks, mode",
    [
        (2, ["--parallel", "data"]),
        (2, ["--parallel", "tensor"]),
        (2, ["--parallel", "pipeline", "--microbatches", "3"]),
        (3, ["--parallel", "pipeline", "--pipeline-schedule", "1f1b", "--microbatches", "4"]),
        (4, ["--parallel", "tensor", "--model-ranks", "2"]),  # 2 replicas x 2 tensor ranks
        (4, ["--parallel", "pipeline", "--tensor-ranks", "2", "--pipeline-schedule", "1f1b"]),
        # 3-D: 2 replicas x 2 stages x 2 tensor parts
        (8, ["--parallel", "pipeline", "--tensor-ranks", "2", "--model-ranks", "4"]),
    ],
    ids=["data", "tensor", "pipeline", "pipeline-1f1b", "tensor-x-data", "pipeline-x-tensor", "3d"],
)
def test_parallel_gpt_computes_the_one_rank_run(tmp_path, corpus, ranks, mode):
    args = gpt_args(corpus)
    one, rec1, _ = train_and_load(tmp_path, 1, args)
    got, rec, _ = train_and_load(tmp_path, ranks, [*args, *mode])
    assert list(got) == list(one)
    assert "layer2.attn.sa.qkv.W" in one
    for name in one:
        # the key bias's gradient is 0 but for round-off (softmax ignores a row's shift): its
        # values are round-off, compared against the largest value of the parameter
        scale = np.abs(one[name]).max()
        close = {"rtol": 1e-9, "atol": 1e-9 * scale, "err_msg": name}
        np.testing.assert_allclose(got[name], one[name], **close)
    assert rec[-1]["ranks_agree"]
    assert rec[0]["test_loss"] == pytest.approx(rec1[0]["test_loss"], rel=1e-9)
    vocab = len(set(Path(corpus).read_text()))
    assert rec1[0]["test_loss"] < np.log(vocab)  # it learned: better than a uniform guess


def test_a_gpt_needs_text_and_heads_dividing_the_embedding(corpus):
    proc = run_xpnn(["--model", "gpt", "--dataset", "synthetic", "--epochs", "1"])
    assert_one_line_user_error(proc, "--model gpt: needs a text data set")
    proc = run_xpnn([*gpt_args(corpus), "--heads", "3"])
    assert_one_line_user_error(proc, "--heads 3: does not divide --embed 8")
    proc = run_xpnn([*gpt_args(corpus), "--parallel", "tensor"], ranks=3)
    assert_one_line_user_error(proc, "splits into 2 parts, fewer than the 3 ranks")
    three = ["--parallel", "pipeline", "--tensor-ranks", "2"]
    proc = run_xpnn([*gpt_args(corpus), *three], ranks=3)
    assert_one_line_user_error(proc, "--tensor-ranks 2: does not divide a replica's 3 ranks")
    proc = run_xpnn(["--dataset", "synthetic", "--epochs", "1", *three], ranks=2)
    assert_one_line_user_error(proc, "--model mlp declares no splits inside its layers")


def test_a_gpt_checkpoint_resumes_exactly(tmp_path, corpus):
    """Nested names carry the parameters and AdamW's state: 1 epoch + resume = 2 epochs (a
    constant rate: a cosine's length is the run's)."""
    constant = [*gpt_args(corpus), "--schedule", "constant"]
    args = [*constant, "--epochs", "2"]
    straight, _, _ = train_and_load(tmp_path, 1, args)
    ck = str(tmp_path / "ck")
    first = run_xpnn([*constant, "--checkpoint-dir", ck])
    assert first.returncode == 0, first.stderr
    resumed, _, _ = train_and_load(tmp_path, 1, [*args, "--checkpoint-dir", ck, "--resume"])
    for name in straight:
        np.testing.assert_array_equal(resumed[name], straight[name], err_msg=name)


GPT_CLIP = 0.05  # below the gradients' global norm in every step: clipping always acts
GPT_RECIPE = [
    "--batch-size", "12", "--steps", "3", "--optimizer", "adamw", "--weight-decay", "0.1",
    "--betas", "0.9,0.95", "--schedule", "cosine", "--warmup-steps", "1", "--min-lr", "0.001",
    "--clip-norm", str(GPT_CLIP),
]  # fmt: skip


@pytest.mark.parametrize(
    "ranks, mode",
    [
        (2, ["--parallel", "tensor"]),
        (2, ["--parallel", "pipeline", "--microbatches", "2"]),
        (4, ["--parallel", "pipeline", "--tensor-ranks", "2"]),  # stages x tensor parts
    ],
    ids=["tensor", "pipeline", "pipeline-x-tensor"],
)
def test_the_clipped_adamw_gpt_on_split_ranks_is_the_one_rank_run(tmp_path, corpus, ranks, mode):
    """The global norm counts each split parameter's slices once and each replicated one
    (LayerNorms, embeddings) once, over every stage and part: the clipped steps agree."""
    args = [*gpt_args(corpus), *GPT_RECIPE]
    one, rec1, _ = train_and_load(tmp_path, 1, args)
    got, rec, _ = train_and_load(tmp_path, ranks, [*args, *mode])
    for name in one:
        scale = np.abs(one[name]).max()
        close = {"rtol": 1e-9, "atol": 1e-9 * scale, "err_msg": name}
        np.testing.assert_allclose(got[name], one[name], **close)
    norms = [r["grad_norm"] for r in rec if "grad_norm" in r]
    norms1 = [r["grad_norm"] for r in rec1 if "grad_norm" in r]
    assert norms and norms == pytest.approx(norms1, rel=1e-9)
    assert min(norms1) > GPT_CLIP
    assert rec[-1]["ranks_agree"]
