"""A ReLU convolution and its 2x2 pool as one layer (``xpnn.nn.conv.Conv2DPool``): the same values,
argmaxes, gradients and checkpoints as the two layers apart; finite differences through it."""

import numpy as np
import pytest

from xpnn.backends import get_backend
from xpnn.backends.numpy_kernels import NumpyKernels
from xpnn.nn import Context, Sequential, cnn
from xpnn.nn.conv import Conv2D, Conv2DPool
from xpnn.nn.pool import MaxPool2D
from xpnn.testing import check_layer
from xpnn.train.checkpoint import save_checkpoint


def _step(fuse, dtype, batch=6, seed=3):
    """The CNN built with or without fusing, one training step: (model, loss, gradients)."""
    model = cnn()
    model.fuse = fuse
    model.build((1, 28, 28), get_backend("numba", dtype), seed)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((batch, 1, 28, 28)).astype(dtype)
    labels = rng.integers(0, 10, batch)
    ctx = Context(train=True, step=2, seed=4, sample_ids=np.arange(batch))
    loss, _ = model.loss_and_grads(x, labels, ctx, 1 / batch)
    return model, float(loss), model.grads.copy()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_fused_cnn_step_equals_the_separate_layers_bit_for_bit(dtype):
    fused, loss, grads = _step(True, dtype)
    apart, loss_apart, grads_apart = _step(False, dtype)
    convs = [layer for layer in fused.layers if isinstance(layer, Conv2DPool)]
    assert [(layer.fused, layer.conv.direct()) for layer in convs] == [
        (True, True),  # the first convolution runs directly, pooled plane by plane
        (True, False),
        (True, False),
    ]
    assert not any(isinstance(layer, Conv2DPool) for layer in apart.layers)
    assert loss == loss_apart
    np.testing.assert_array_equal(grads, grads_apart)
    assert np.count_nonzero(grads[320:1472]) > 1000  # the second convolution learned
    assert fused.size == apart.size == 690590
    assert fused.summary().count("(fused)") == 3
    assert fused.summary().replace(" (fused)", "") == apart.summary()


@pytest.mark.parametrize(
    "channels, padding, read",
    [(3, 0, (6, 6)), (1, 1, (8, 10))],  # im2col; direct (9 taps)
)
def test_fused_layer_matches_finite_differences_float64(channels, padding, read):
    layer = Conv2DPool(Conv2D(4, 3, padding=padding, activation="relu"), MaxPool2D(2))
    check_layer(layer, (channels, 9, 8 + 2 * padding), backend="numba", atol=1e-6)
    assert layer.fused and layer.conv.used_hw == read  # of 7x6 and 9x10: what the pool reads
    assert layer.conv.direct() == (channels == 1)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_direct_fused_kernels_equal_the_direct_convolution_and_pool(dtype):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((5, 1, 11, 10)).astype(dtype)
    w = rng.standard_normal((6, 1, 3, 3)).astype(dtype)
    b = np.linspace(-1, 1, 6).astype(dtype)
    generic, numba = NumpyKernels(np), get_backend("numba", dtype).kernels
    y_full = numba.conv_direct(x, w, b, 1, 1, (10, 10), "relu")
    y, idx = generic.maxpool2d_forward(y_full, 2, 2)
    dy = rng.standard_normal(y.shape).astype(dtype)
    dz = generic.maxpool2d_backward(dy, idx, y_full.shape, 2, 2)
    want_dw = np.empty_like(w)
    want_db, want_dx = numba.conv_direct_backward(dz, x, y_full, w, 1, 1, "relu", want_dw, True)
    tight = {"rtol": 1e-5 if dtype == "float32" else 1e-12, "atol": 1e-6}
    for k in (generic, numba):  # the generic one by im2col and a GEMM: within round-off
        got, got_idx = k.conv_direct_relu_pool(x, w, b, 1, 1, (10, 10))
        np.testing.assert_allclose(got, y, **(tight if k is generic else {"rtol": 0}))
        np.testing.assert_array_equal(got_idx, idx)
        dw = np.empty_like(w)
        db, dx = k.conv_direct_relu_pool_backward(dy, x, y, idx, w, 1, 1, dw, True)
        np.testing.assert_allclose(dw, want_dw, **tight)
        np.testing.assert_allclose(db, want_db, **tight)
        np.testing.assert_allclose(dx, want_dx, **tight)
    assert np.count_nonzero(want_dx) > 0


def _kernels_pair(ties):
    """(GEMM result, bias, shape) with ties, all-negative windows, NaN and -0.0 in windows."""
    n, c, oh, ow = shape = (3, 4, 6, 4)
    rng = np.random.default_rng(2)
    yc = rng.integers(-3, 3, (c, n * oh * ow)).astype(np.float32) if ties else None
    if not ties:
        yc = rng.standard_normal((c, n * oh * ow)).astype(np.float32)
    yc[0, :4] = [np.nan, 1, 5, np.nan]
    yc[1, 8:12] = [-0.0, 0.0, -0.0, 0.0]
    yc[2, :] = -7  # every window of channel 2 below zero after its bias
    return yc, np.array([0.0, 0.5, 1.0, -0.25], np.float32), shape


@pytest.mark.parametrize("ties", [True, False])
def test_fused_kernels_pick_the_pools_argmax_and_give_its_gradient(ties):
    yc, b, shape = _kernels_pair(ties)
    generic, numba = NumpyKernels(np), get_backend("numba").kernels
    y, idx = generic.maxpool2d_forward(generic.conv_output(yc, b, shape, "relu"), 2, 2)
    for k in (generic, numba):
        got, got_idx = k.conv_relu_pool(yc, b, shape)
        np.testing.assert_array_equal(got, y)  # NaN where NaN
        np.testing.assert_array_equal(got_idx, idx)
    dy = np.random.default_rng(3).standard_normal(y.shape).astype(np.float32)
    want, want_db = numba.conv_output_grad(
        generic.maxpool2d_backward(dy, idx, shape, 2, 2),
        y=generic.conv_output(yc, b, shape, "relu"),
        act="relu",
    )
    for k in (generic, numba):
        dz, db = k.conv_relu_pool_grad(dy, y, idx, shape, np.full_like(yc, np.inf))
        np.testing.assert_array_equal(dz, want)
        np.testing.assert_allclose(db, want_db, rtol=1e-5, atol=1e-5)  # summed in its order
    assert np.count_nonzero(want) > 0 and np.all(want[2] == 0)


def test_a_checkpoint_of_the_fused_cnn_loads_into_the_separate_layers_and_back(tmp_path):
    fused, _, _ = _step(True, "float64")
    apart = cnn()
    apart.fuse = False
    apart.build((1, 28, 28), get_backend("numba", "float64"), seed=9)  # other weights
    path = save_checkpoint(tmp_path, dict(fused.named_params()), {}, 1, 1, 3)
    stored = dict(np.load(path))
    for name, view in apart.named_views(apart.params).items():
        view[...] = stored[name]
    np.testing.assert_array_equal(apart.params, fused.params)
    again, _, _ = _step(True, "float64", seed=8)
    for name, view in again.named_views(again.params).items():
        view[...] = apart.named_params()[name]
    np.testing.assert_array_equal(again.params, fused.params)
    x = np.random.default_rng(1).standard_normal((2, 1, 28, 28))
    np.testing.assert_array_equal(again.predict(x), apart.predict(x))


def test_fusing_is_the_users_to_switch_off_and_only_where_the_kernels_pay():
    layers = [Conv2D(4, 3, activation="relu"), MaxPool2D(2), Conv2D(2, 3), MaxPool2D(2)]
    model = Sequential(list(layers)).build((5, 12, 12), get_backend("numba"), 0)
    assert [type(layer).__name__ for layer in model.layers] == ["Conv2DPool", "Conv2D", "MaxPool2D"]
    assert model.layers[0].conv is layers[0] and model.layers[0].fused
    off = Sequential(list(layers), fuse=False).build((5, 12, 12), get_backend("numba"), 0)
    assert off.layers == layers
    numpy = Sequential(list(layers)).build((5, 12, 12), get_backend("numpy"), 0)
    assert numpy.layers == layers
    model.fuse = False
    assert model.build((5, 12, 12), get_backend("numba"), 0).layers == layers  # taken apart
