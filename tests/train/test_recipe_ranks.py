"""The training recipe (AdamW, warmup and cosine, clipping by the global norm, gradient
accumulation) on N ranks computes the 1-rank run, in float64 under real mpiexec: N ranks x K
micro-steps = 1 rank taking the same global batch at once."""

import json

import numpy as np
import pytest
from conftest import CNN_DROPOUT_RUN, TINY_FLOAT64_RUN, run_xpnn, train_and_load

CLIP = 0.05  # below the gradients' norm in every step of this run: clipping always acts
RECIPE = [
    *TINY_FLOAT64_RUN, "--hidden", "24,16", "--optimizer", "adamw", "--weight-decay", "0.1",
    "--betas", "0.9,0.95", "--schedule", "cosine", "--warmup-steps", "2", "--min-lr", "0.001",
    "--clip-norm", str(CLIP),
]  # fmt: skip


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return train_and_load(tmp_path_factory.mktemp("one"), 1, RECIPE)


def _assert_same_run(got, records, one_rank):
    one, rec1, _ = one_rank
    assert list(got) == list(one)
    for name in one:
        np.testing.assert_allclose(got[name], one[name], rtol=1e-9, atol=1e-12, err_msg=name)
    for r, r1 in zip(records[:-1], rec1[:-1], strict=True):
        assert r["train_loss"] == pytest.approx(r1["train_loss"], rel=1e-9)
        assert r["grad_norm"] == pytest.approx(r1["grad_norm"], rel=1e-9)
        assert r["grad_norm"] > CLIP
    assert records[-1]["ranks_agree"]


@pytest.mark.parametrize(
    ("ranks", "flags", "update"),
    [
        (1, ["--accumulate", "3"], "local"),
        (2, ["--accumulate", "2"], "shared gradients"),
        (2, ["--accumulate", "3", "--comm", "mpi-host", "--bucket-mb", "0.001"], "allreduce"),
        (2, ["--node-share", "activations"], "shared activations"),
        (2, ["--parallel", "tensor", "--accumulate", "2"], "local"),
        (2, ["--parallel", "pipeline", "--microbatches", "2", "--accumulate", "2"], "local"),
        (4, ["--parallel", "tensor", "--model-ranks", "2", "--accumulate", "2"], None),
    ],
    ids=[
        "1-rank-accumulate",
        "data-shm",
        "data-host",
        "data-activations",
        "tensor",
        "pipeline",
        "tensor-x-data",
    ],  # fmt: skip
)
def test_the_recipe_on_n_ranks_is_the_one_rank_run(tmp_path, one_rank, ranks, flags, update):
    got, records, _ = train_and_load(tmp_path, ranks, [*RECIPE, *flags])
    if update is not None:
        assert records[-1]["update"] == update
    _assert_same_run(got, records, one_rank)


def test_accumulation_without_clipping_is_the_same_step(tmp_path):
    base = [*TINY_FLOAT64_RUN, "--hidden", "24,16"]
    one, _, _ = train_and_load(tmp_path, 1, base)
    two, _, _ = train_and_load(tmp_path, 2, [*base, "--accumulate", "4", "--comm", "mpi-host"])
    for name in one:
        np.testing.assert_allclose(two[name], one[name], rtol=1e-9, atol=1e-12)


def test_steps_are_the_epochs_they_add_up_to(tmp_path):
    """300 samples in batches of 70: 5 steps an epoch, so --steps 10 is --epochs 2, with an
    evaluation record every 4 steps and at the end."""
    base = [*TINY_FLOAT64_RUN, "--hidden", "24,16", "--schedule", "cosine"]
    epochs, _, _ = train_and_load(tmp_path, 1, base)
    steps, records, _ = train_and_load(tmp_path, 2, [*base, "--steps", "10", "--eval-every", "4"])
    for name in epochs:
        np.testing.assert_allclose(steps[name], epochs[name], rtol=1e-9, atol=1e-12)
    evals = [r for r in records if r["event"] == "eval"]
    assert [r["step"] for r in evals] == [4, 8, 10]
    assert [r["epoch"] for r in evals] == [0.8, 1.6, 2.0]
    assert all(np.isfinite(r["test_loss"]) and 0 <= r["test_acc"] <= 1 for r in evals)
    assert records[-1]["event"] == "done" and records[-1]["steps"] == 10
    assert records[-1]["test_loss"] == evals[-1]["test_loss"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--accumulate", "71"], "--accumulate 71: more micro-steps than the global batch's 70"),
        (["--warmup-steps", "2", "--warmup-epochs", "1"], "--warmup-steps and --warmup-epochs"),
        (["--betas", "0.9"], "--betas: expected two rates like 0.9,0.999"),
        (["--momentum", "1"], "--momentum: must be below 1"),
        (["--schedule", "cosine", "--min-lr", "0.5"], "--min-lr: must be from 0 to --lr"),
    ],
)
def test_bad_recipe_flags_are_one_line_errors(tmp_path, flags, message):
    flags = [str(tmp_path / "ckpt") if f == "CKPT" else f for f in flags]
    proc = run_xpnn([*TINY_FLOAT64_RUN, *flags])
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_the_recipe_on_the_cnn_with_dropout(tmp_path):
    """Convolution kernels decay as matrices; each micro-step draws its samples' own dropout
    masks, so 2 ranks x 3 micro-steps are the 1-rank run."""
    recipe = ["--optimizer", "adamw", "--weight-decay", "0.1", "--clip-norm", "0.01"]
    one, rec1, _ = train_and_load(tmp_path, 1, [*CNN_DROPOUT_RUN, *recipe])
    two, rec2, _ = train_and_load(
        tmp_path, 2, [*CNN_DROPOUT_RUN, *recipe, "--accumulate", "3", "--comm", "mpi-host"]
    )
    for name in one:
        np.testing.assert_allclose(two[name], one[name], rtol=1e-9, atol=1e-12, err_msg=name)
    assert rec2[0]["grad_norm"] == pytest.approx(rec1[0]["grad_norm"], rel=1e-9)
    assert rec1[0]["grad_norm"] > 0.01


@pytest.mark.parametrize("node_share", ["gradients", "activations"])
def test_the_recipe_over_two_nodes_of_shared_memory(tmp_path, one_rank, node_share):
    """4 ranks as 2 nodes of 2 (each node one copy of the parameters, its ranks each a share):
    the norm adds the shares of a node once, not once per node."""
    saved, metrics = tmp_path / "p.npz", tmp_path / "m.jsonl"
    flags = ["--comm", "mpi-shm", "--node-share", node_share, "--threads", "1"]
    if node_share == "gradients":
        flags += ["--accumulate", "2"]
    proc = run_xpnn(
        [*RECIPE, *flags, "--save", str(saved), "--metrics", str(metrics)],
        ranks=4,
        env={"XPNN_RANKS_PER_NODE": "2"},
    )
    assert proc.returncode == 0, proc.stderr
    with np.load(saved) as data:
        got = {k: data[k] for k in data.files}
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert records[-1]["update"] == f"shared {node_share}"
    _assert_same_run(got, records, one_rank)
