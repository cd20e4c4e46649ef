"""Tensor parallelism: split Dense layers, checked by finite differences and under real mpiexec."""

import json

import numpy as np
import pytest
from conftest import (
    TINY_FLOAT64_RUN,
    assert_failing_rank_stops_the_job,
    assert_one_line_user_error,
    run_xpnn,
    train_and_load,
)

from xpnn.backends import get_backend
from xpnn.errors import UserError
from xpnn.nn import Flatten, build_model
from xpnn.nn.dense import Dense
from xpnn.parallel.comm import SelfCommunicator
from xpnn.parallel.model.tensor import ColumnDense, RowDense, split_layers
from xpnn.parallel.model.whole import whole_size
from xpnn.testing import check_layer


def _alone(layer):
    layer.comm = SelfCommunicator()


@pytest.mark.parametrize("act", ["identity", "relu", "tanh", "sigmoid"])
def test_column_dense_backward_matches_finite_differences(act):
    """Units 2:5 of 6: the output is those units; dx is their part of the input gradient."""
    check_layer(ColumnDense(6, act, (2, 5)), (7,), batch=4, before_forward=_alone)


@pytest.mark.parametrize("act", ["identity", "relu", "tanh"])
def test_row_dense_backward_matches_finite_differences(act):
    """Rows 1:4 of 7: the input is that slice of the activations."""
    check_layer(RowDense(5, act, (1, 4)), (7,), batch=4, x_shape=(3,), before_forward=_alone)


def test_every_rank_keeps_its_slice_of_the_one_rank_initial_weights():
    backend = get_backend("numpy", "float64")
    full = build_model("mlp", (9, 6)).build((1, 4, 4), backend, seed=3).named_params()
    parts = []
    for rank in range(2):
        model = build_model("mlp", (9, 6))
        model.layers = split_layers(model.layers, rank, 2)
        model.build((1, 4, 4), backend, seed=3)
        parts.append(model.named_params())
        assert whole_size(model) == sum(p.size for p in full.values())
    np.testing.assert_array_equal(np.hstack([p["layer0.W"] for p in parts]), full["layer0.W"])
    np.testing.assert_array_equal(np.hstack([p["layer0.b"] for p in parts]), full["layer0.b"])
    np.testing.assert_array_equal(np.vstack([p["layer1.W"] for p in parts]), full["layer1.W"])
    for name in ("layer1.b", "layer2.W", "layer2.b"):  # replicated
        np.testing.assert_array_equal(parts[0][name], full[name])
        np.testing.assert_array_equal(parts[1][name], full[name])
    assert parts[0]["layer0.W"].shape == (16, 5) and parts[1]["layer0.W"].shape == (16, 4)


def test_dense_layers_are_paired_and_a_last_odd_one_is_replicated():
    layers = split_layers([Flatten(), Dense(8, "relu"), Dense(6, "relu"), Dense(3)], 1, 2)
    kinds = [type(layer).__name__ for layer in layers]
    assert kinds == ["Flatten", "ColumnDense", "RowDense", "Dense"]
    assert (layers[1].lo, layers[1].hi) == (layers[2].lo, layers[2].hi) == (4, 8)
    four = split_layers([Dense(8), Dense(6), Dense(4), Dense(3)], 0, 3)
    assert [type(layer).__name__ for layer in four] == [
        "ColumnDense",
        "RowDense",
        "ColumnDense",
        "RowDense",
    ]


def test_one_process_tensor_parallel_is_the_plain_network():
    backend = get_backend("numpy", "float64")
    plain = build_model("mlp", (9, 6)).build((1, 4, 4), backend, seed=0)
    split = build_model("mlp", (9, 6))
    split.layers = split_layers(split.layers, 0, 1)
    split.build((1, 4, 4), backend, seed=0)
    split.attach(SelfCommunicator())
    x = np.random.default_rng(1).standard_normal((5, 1, 4, 4))
    labels = np.array([0, 3, 9, 2, 2])
    from xpnn.nn.layer import Context

    out = [m.loss_and_grads(x, labels, Context(train=True), 0.2) for m in (plain, split)]
    assert float(out[0][0]) == pytest.approx(float(out[1][0]), rel=1e-14)
    np.testing.assert_allclose(split.grads, plain.grads, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize(
    "layers, message",
    [
        ([Flatten(), Dense(1, "relu"), Dense(4)], "a layer of 1 units cannot be split over 2"),
    ],
)
def test_what_cannot_be_split_is_a_user_error(layers, message):
    with pytest.raises(UserError, match=message):
        split_layers(layers, 0, 2)


def test_a_layer_that_declares_no_split_is_named():
    with pytest.raises(
        UserError, match=r"Conv2D\(.*cannot be split \(it declares tensor_split 'none'"
    ):
        split_layers(build_model("cnn").layers, 0, 2)


def test_the_split_follows_what_layers_declare():
    """An elementwise layer runs on a slice between a pair; a replicated one may not."""
    from xpnn.nn import Tanh

    layers = [Flatten(), Dense(8), Tanh(), Dense(4)]
    out = split_layers(layers, 1, 2)
    assert [type(layer) for layer in out] == [Flatten, ColumnDense, Tanh, RowDense]
    assert (out[1].lo, out[1].hi) == (4, 8) and (out[3].lo, out[3].hi) == (4, 8)
    with pytest.raises(UserError, match=r"Flatten\(\) cannot be split between a split pair"):
        split_layers([Flatten(), Dense(8), Flatten(), Dense(4)], 0, 2)


# -- real mpiexec ----------------------------------------------------------------------------
BASE = TINY_FLOAT64_RUN


def _train(tmp_path, ranks, hidden, *extra):
    if ranks == 1:  # the reference run, trained once per pytest run for its arguments
        return train_and_load(tmp_path, 1, [*BASE, "--hidden", hidden, *extra])
    saved = tmp_path / f"{ranks}{'-'.join(extra)}.npz"
    metrics = saved.with_suffix(".jsonl")
    args = [*BASE, "--hidden", hidden, *extra, "--save", str(saved), "--metrics", str(metrics)]
    proc = run_xpnn(args, ranks=ranks)
    assert proc.returncode == 0, proc.stderr
    with np.load(saved) as data:
        params = {k: data[k] for k in data.files}
    return params, [json.loads(line) for line in metrics.read_text().splitlines()], proc


@pytest.mark.parametrize("hidden", ["96,700", "96,700,64"])
def test_two_and_three_ranks_tensor_parallel_compute_the_one_rank_run(tmp_path, hidden):
    """96,700: one split pair and a replicated output layer; 96,700,64: two pairs, so the
    second pair's column-split layer sends its input gradient back (an allreduce)."""
    one, rec1, _ = _train(tmp_path, 1, hidden)
    for ranks in (2, 3):
        tp, rec, proc = _train(tmp_path, ranks, hidden, "--parallel", "tensor")
        assert set(tp) == set(one)
        for name in one:
            assert tp[name].shape == one[name].shape
            # the partial products are summed in another order: 1e-10 of each array's scale
            scale = np.abs(one[name]).max()
            np.testing.assert_allclose(
                tp[name], one[name], rtol=0, atol=1e-10 * scale, err_msg=name
            )
        done = rec[-1]
        assert done["parallel"] == "tensor" and done["world_size"] == ranks
        assert done["comm"] == "mpi-host"  # auto: no parameters to share between ranks
        assert done["ranks_agree"] and done["params"] == rec1[-1]["params"]
        assert done["global_batch"] == 70  # every rank sees the whole batch
        for r1, r in zip(rec1[:2], rec[:2], strict=True):  # metrics counted once, not per rank
            assert r["train_loss"] == pytest.approx(r1["train_loss"], rel=1e-10)
            assert r["test_acc"] == r1["test_acc"]
        assert "tensor parallel" in proc.stdout
    assert rec1[1]["train_loss"] < rec1[0]["train_loss"]  # it trained: equality is not trivial


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--model", "cnn"],
            "--parallel tensor: Conv2D(32, 3x3, relu) cannot be split (it declares",
        ),
        (["--hidden", "1,8"], "a layer of 1 units cannot be split over 2 ranks"),
    ],
)
def test_tensor_parallel_user_errors_are_one_line_exit_2(tmp_path, args, message):
    proc = run_xpnn([*BASE, "--parallel", "tensor", *args, "--epochs", "1"], ranks=2, timeout=120)
    assert_one_line_user_error(proc, message)


def test_one_failing_rank_stops_a_tensor_parallel_job():
    """Rank 1 raises at step 3 while rank 0 waits in the forward pass's allreduce for it."""
    args = [*BASE, "--hidden", "96,700", "--parallel", "tensor", "--epochs", "50"]
    assert_failing_rank_stops_the_job(args)
