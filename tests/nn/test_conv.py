"""Conv2D, MaxPool2D and Dropout: finite differences, numba == numpy, array-api-strict == numpy,
the cnn preset, buffer reuse and the dropout mask's independence from batch composition."""

import array_api_strict as xs
import numpy as np
import pytest
from conftest import cnn_preset_step

from xpnn.backends import get_backend
from xpnn.backends.base import Backend
from xpnn.backends.kernels import Kernels
from xpnn.backends.numpy_kernels import NumpyKernels
from xpnn.nn import Context, Dense, Flatten, ReLU, Sequential, cnn
from xpnn.nn.conv import Conv2D
from xpnn.nn.dropout import Dropout
from xpnn.nn.pool import MaxPool2D
from xpnn.testing import check_layer, numeric_grad

RTOL = 1e-10


def _strict_backend() -> Backend:
    backend = Backend(xs, Kernels(xs), "float64")
    backend.to_host = lambda a: np.from_dlpack(a)
    return backend


def _ctx(n, step=1, seed=3, ids=None, train=True):
    return Context(
        train=train, step=step, seed=seed, sample_ids=np.arange(n) if ids is None else ids
    )


# -- finite differences (numpy backend, float64) ----------------------------------------------
@pytest.mark.parametrize(
    "layer, in_shape",
    [
        (lambda: Conv2D(3, 3), (2, 5, 6)),
        (lambda: Conv2D(2, (3, 2), stride=2, padding=1), (2, 7, 6)),
        (lambda: Conv2D(2, 2, stride=3, padding=2), (1, 5, 5)),
        (lambda: Conv2D(4, 1), (3, 3, 3)),
        (lambda: Conv2D(3, 2, activation="tanh"), (2, 4, 5)),
        (lambda: Conv2D(3, 2, stride=2, activation="sigmoid"), (2, 5, 5)),
        (lambda: Conv2D(3, 2, padding=1, activation="relu"), (2, 4, 3)),
    ],
)
def test_conv2d_matches_finite_differences(layer, in_shape):
    check_layer(layer(), in_shape, batch=2)


@pytest.mark.parametrize(
    "layer, in_shape",
    [
        (lambda: MaxPool2D(2), (2, 5, 7)),  # odd sizes: floor mode drops the last row/column
        (lambda: MaxPool2D(3, stride=2), (2, 7, 6)),  # overlapping windows
        (lambda: MaxPool2D(2, stride=3), (1, 7, 8)),  # gaps between windows
    ],
)
def test_maxpool_matches_finite_differences(layer, in_shape):
    check_layer(layer(), in_shape, batch=2)


def test_dropout_matches_finite_differences_with_its_mask_fixed():
    layer = Dropout(0.4)
    check_layer(layer, (3, 4, 5), batch=3)  # same ctx every call -> the same mask
    mask = np.asarray(layer.mask)
    assert set(np.unique(mask)) <= {0.0, 1 / 0.6}
    dy = np.random.default_rng(0).standard_normal(mask.shape)
    np.testing.assert_array_equal(layer.backward(dy), dy * mask)


def test_layer_output_shapes_follow_floor_mode():
    backend = get_backend("numpy", "float64")
    layers = [
        Conv2D(4, 3, stride=2, padding=1),
        MaxPool2D(2),
        Conv2D(2, (2, 1)),
        MaxPool2D(2, stride=1),
    ]
    model = Sequential(layers).build((1, 13, 12), backend, 0)
    assert model.output_shape == (2, 1, 2)
    assert model.forward(np.ones((3, 1, 13, 12)), Context()).shape == (3, 2, 1, 2)
    with pytest.raises(ValueError):
        Sequential([MaxPool2D(3)]).build((1, 2, 5), backend, 0)


# -- numba == numpy ---------------------------------------------------------------------------
def _layer_run(backend, make, in_shape, batch=4, seed=0):
    layer = make()
    Sequential([layer]).build(in_shape, backend, seed)
    rng = np.random.default_rng(seed + 10)
    x = backend.asarray(rng.standard_normal((batch, *in_shape)))
    ctx = _ctx(batch, ids=backend.asarray(np.arange(100, 100 + batch), dtype=backend.xp.int64))
    y = layer.forward(x, ctx)
    dy = backend.asarray(rng.standard_normal(y.shape))
    dx = layer.backward(dy, need_dx=True)
    out = {"y": backend.to_host(y), "dx": backend.to_host(dx)}
    out.update({k: backend.to_host(g).copy() for k, g in layer.grads.items()})
    return out


LAYERS = [
    (lambda: Conv2D(5, 3), (3, 9, 8)),
    (lambda: Conv2D(5, 3, activation="relu"), (3, 9, 8)),
    (lambda: Conv2D(3, 2, activation="sigmoid"), (2, 6, 5)),
    (lambda: Conv2D(3, 2, stride=2, padding=1, activation="tanh"), (2, 6, 5)),
    (lambda: Conv2D(4, (2, 3), stride=2, padding=1), (2, 9, 10)),
    (lambda: MaxPool2D(2), (3, 9, 7)),
    (lambda: MaxPool2D(3, stride=2), (2, 9, 8)),
    (lambda: Dropout(0.3), (3, 4, 5)),
    (lambda: Dropout(0.6), (17,)),
]


@pytest.mark.parametrize("make, in_shape", LAYERS)
def test_numba_layers_equal_numpy_float64(make, in_shape):
    ref = _layer_run(get_backend("numpy", "float64"), make, in_shape)
    got = _layer_run(get_backend("numba", "float64"), make, in_shape)
    for key in ref:
        np.testing.assert_allclose(got[key], ref[key], rtol=RTOL, atol=1e-13, err_msg=key)


@pytest.mark.parametrize("make, in_shape", LAYERS)
def test_array_api_strict_layers_equal_numpy(make, in_shape):
    ref = _layer_run(get_backend("numpy", "float64"), make, in_shape)
    got = _layer_run(_strict_backend(), make, in_shape)
    for key in ref:
        np.testing.assert_allclose(got[key], ref[key], rtol=1e-12, atol=1e-14, err_msg=key)


@pytest.mark.parametrize(
    "shape", [(2, 3, 7, 6, 3, 2, 1, 0), (3, 2, 9, 8, 3, 3, 2, 1), (2, 1, 5, 5, 2, 3, 3, 2)]
)
def test_im2col_col2im_agree_across_kernel_tables_and_are_adjoint(shape):
    n, c, h, w, kh, kw, s, p = shape
    from xpnn.backends.numba_kernels import NumbaKernels

    tables = [Kernels(np), NumpyKernels(np), NumbaKernels(np)]
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, c, h, w))
    cols = [t.im2col(x, kh, kw, s, p) for t in tables]
    for other in cols[1:]:
        np.testing.assert_array_equal(other, cols[0])
    d = rng.standard_normal(cols[0].shape)
    dxs = [t.col2im(d.copy(), x.shape, kh, kw, s, p) for t in tables]
    for other in dxs[1:]:
        np.testing.assert_allclose(other, dxs[0], rtol=1e-14)
    assert np.isclose(np.sum(cols[0] * d), np.sum(x * dxs[0]))  # <im2col x, d> = <x, col2im d>


@pytest.mark.parametrize(
    "shape, out_hw",
    [((2, 3, 13, 13, 3, 3, 1, 0), (10, 10)), ((3, 2, 9, 8, 3, 3, 2, 1), (4, 2))],
)
def test_im2col_col2im_with_out_hw_keep_only_the_first_outputs(shape, out_hw):
    n, c, h, w, kh, kw, s, p = shape
    from xpnn.backends.numba_kernels import NumbaKernels

    rng = np.random.default_rng(2)
    x = rng.standard_normal((n, c, h, w))
    full = Kernels(np).im2col(x, kh, kw, s, p)
    oh, ow = (h + 2 * p - kh) // s + 1, (w + 2 * p - kw) // s + 1
    want = full.reshape(-1, n, oh, ow)[:, :, : out_hw[0], : out_hw[1]].reshape(c * kh * kw, -1)
    d = rng.standard_normal(want.shape)
    d_full = np.zeros((c * kh * kw, n, oh, ow))
    d_full[:, :, : out_hw[0], : out_hw[1]] = d.reshape(-1, n, *out_hw)
    dx_want = Kernels(np).col2im(d_full.reshape(full.shape), x.shape, kh, kw, s, p)
    for t in (Kernels(np), NumpyKernels(np), NumbaKernels(np)):
        np.testing.assert_array_equal(t.im2col(x, kh, kw, s, p, out_hw=out_hw), want)
        dx = t.col2im(d.copy(), x.shape, kh, kw, s, p, out_hw=out_hw)
        np.testing.assert_allclose(dx, dx_want, rtol=1e-13, atol=1e-14)
    with pytest.raises(ValueError, match="out_hw"):
        Kernels(np).im2col(x, kh, kw, s, p, out_hw=(oh + 1, ow))


def _conv_pool_net() -> Sequential:
    """Floor-mode pools that drop rows and columns, after convolutions with padding/stride."""
    return Sequential(
        [
            Conv2D(3, 3, stride=2, padding=1, activation="tanh"),  # 9x8 -> 5x4, pool reads 4x4
            MaxPool2D(2),
            Conv2D(2, 2, activation="relu"),  # 2x2 -> 1x1: pool(1) keeps all
            MaxPool2D(1),
            Flatten(),
            Dense(3),
        ]
    )


def test_convolutions_skip_outputs_the_next_pool_never_reads():
    backend = get_backend("numpy", "float64")
    model = cnn().build((1, 28, 28), backend, seed=0)
    convs = [layer for layer in model.layers if isinstance(layer, Conv2D)]
    assert [c.out_hw for c in convs] == [(26, 26), (11, 11), (3, 3)]
    assert [c.used_hw for c in convs] == [(26, 26), (10, 10), (2, 2)]
    assert "computes 2x2 of 3x3" in model.summary()
    assert repr(Conv2D(4, 3, stride=2)) == "Conv2D(4, 3x3, stride=2)"  # unbuilt: no extent yet
    net = _conv_pool_net().build((2, 9, 8), backend, seed=1)
    assert [c.used_hw for c in net.layers if isinstance(c, Conv2D)] == [(4, 4), (1, 1)]


def test_conv_pool_net_with_skipped_outputs_matches_finite_differences():
    backend = get_backend("numpy", "float64")
    model = _conv_pool_net().build((2, 9, 8), backend, seed=1)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((3, 2, 9, 8))
    y = np.array([0, 2, 1])

    def f() -> float:
        return float(model.evaluate(x, y)[0]) / 3

    model.loss_and_grads(x, y, Context(train=True), 1 / 3)
    np.testing.assert_allclose(model.grads, numeric_grad(f, model.params), rtol=1e-5, atol=1e-8)
    assert np.any(model.grads[:12] != 0)


@pytest.mark.parametrize("backend_name", ["numpy", "numba"])
def test_cnn_with_skipped_outputs_equals_computing_them_all(backend_name):
    """Limited convolutions give the loss and gradients of full ones (float64)."""
    results = []
    for limited in (True, False):
        backend = get_backend(backend_name, "float64")
        model = cnn().build((1, 28, 28), backend, seed=3)
        if not limited:
            for layer in model.layers:
                if isinstance(layer, Conv2D):
                    layer.limit_output(*layer.out_hw)
        rng = np.random.default_rng(8)
        x = rng.random((5, 1, 28, 28))
        y = rng.integers(0, 10, 5)
        ctx = Context(train=True, step=2, seed=4, sample_ids=np.arange(5))
        loss, _ = model.loss_and_grads(x, y, ctx, 1 / 5)
        results.append((float(loss), model.grads.copy()))
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-12)
    np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-10, atol=1e-14)


def test_cnn_preset_has_690590_parameters_and_numba_equals_numpy():
    m_ref, logits_ref, loss_ref, grads_ref = cnn_preset_step(get_backend("numpy", "float64"))
    assert m_ref.size == 690590 == m_ref.params.size
    _, logits, loss, grads = cnn_preset_step(get_backend("numba", "float64"))
    np.testing.assert_allclose(logits, logits_ref, rtol=RTOL, atol=1e-13)
    np.testing.assert_allclose(loss, loss_ref, rtol=RTOL)
    np.testing.assert_allclose(grads, grads_ref, rtol=RTOL, atol=1e-13)
    assert np.any(grads_ref[:320] != 0)  # the first convolution did get gradients


def test_small_conv_net_on_array_api_strict_equals_numpy():
    def run(backend):
        model = Sequential(
            [
                Conv2D(3, 3, padding=1),
                ReLU(),
                MaxPool2D(2),
                Conv2D(4, 2, stride=2),
                ReLU(),
                Flatten(),
                Dropout(0.3),
                Dense(5),
            ]
        ).build((2, 9, 9), backend, seed=2)
        rng = np.random.default_rng(3)
        x = backend.asarray(rng.standard_normal((4, 2, 9, 9)))
        y = backend.asarray(rng.integers(0, 5, 4), dtype=backend.xp.int64)
        ids = backend.asarray(np.array([7, 1, 8, 2]), dtype=backend.xp.int64)
        loss, _ = model.loss_and_grads(
            x, y, Context(train=True, step=2, seed=9, sample_ids=ids), 1 / 4
        )
        return float(loss), backend.to_host(model.grads).copy()

    loss_ref, grads_ref = run(get_backend("numpy", "float64"))
    loss, grads = run(_strict_backend())
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-12)
    np.testing.assert_allclose(grads, grads_ref, rtol=1e-12, atol=1e-14)


def test_fused_activation_equals_a_separate_activation_layer():
    backend = get_backend("numba", "float64")
    rng = np.random.default_rng(5)
    x, dy = rng.standard_normal((3, 2, 7, 7)), rng.standard_normal((3, 4, 5, 5))
    outs = []
    for layers in ([Conv2D(4, 3, activation="relu")], [Conv2D(4, 3), ReLU()]):
        model = Sequential(layers).build((2, 7, 7), backend, 1)
        y = model.forward(x, Context()).copy()
        d = dy
        for layer in reversed(layers):
            d = layer.backward(d)
        outs.append((y, d, model.grads.copy()))
    for a, b in zip(*outs, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError):
        Conv2D(4, 3, activation="softplus")


# -- dropout masks -----------------------------------------------------------------------------
def _masks(kernels, xp, ids, shape=(3, 5), p=0.5, seed=7, step=3, dtype="float32"):
    m = kernels.dropout_mask(
        (len(ids), *shape),
        p,
        seed,
        step,
        xp.asarray(np.asarray(ids), dtype=xp.int64),
        getattr(xp, dtype),
    )
    return np.asarray(m) if xp is np else np.from_dlpack(m)


def test_dropout_mask_of_a_sample_ignores_batch_composition_and_backend():
    from xpnn.backends.numba_kernels import NumbaKernels

    ids = np.array([3, 10, 2**40 + 5, 0, 77, 5, 123456, 9])
    tables = [(Kernels(np), np), (NumpyKernels(np), np), (NumbaKernels(np), np), (Kernels(xs), xs)]
    for dtype in ("float32", "float64"):
        whole = _masks(Kernels(np), np, ids, dtype=dtype)
        for k, xp in tables:
            np.testing.assert_array_equal(_masks(k, xp, ids, dtype=dtype), whole)
            perm = np.random.default_rng(0).permutation(len(ids))
            np.testing.assert_array_equal(_masks(k, xp, ids[perm], dtype=dtype), whole[perm])
            # split as over two ranks
            parts = [_masks(k, xp, ids[:3], dtype=dtype), _masks(k, xp, ids[3:], dtype=dtype)]
            np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_dropout_mask_depends_on_seed_step_and_salt_and_keeps_about_1_minus_p():
    k = NumpyKernels(np)
    ids = np.arange(200)
    base = k.dropout_mask((200, 300), 0.3, 1, 2, ids, np.float32)
    assert abs(np.mean(base > 0) - 0.7) < 0.01
    assert set(np.unique(base)) == {0.0, np.float32(1 / 0.7)}
    for other in (
        k.dropout_mask((200, 300), 0.3, 2, 2, ids, np.float32),
        k.dropout_mask((200, 300), 0.3, 1, 3, ids, np.float32),
        k.dropout_mask((200, 300), 0.3, 1, 2, ids, np.float32, salt=1),
    ):
        assert 0.3 < np.mean((other > 0) != (base > 0)) < 0.5
    # pinned: a change of the hash would silently change resumed runs
    pinned = k.dropout_mask((1, 32), 0.5, 0, 0, np.array([0]), np.float64)
    assert "".join("1" if v else "0" for v in pinned[0]) == PINNED_MASK


PINNED_MASK = "11100110101000111011001010101010"  # seed 0, step 0, sample 0, p = 0.5


def test_dropout_is_identity_in_eval_and_uses_positions_without_sample_ids():
    backend = get_backend("numpy", "float64")
    layer = Dropout(0.5)
    Sequential([layer]).build((6,), backend, 0)
    x = np.random.default_rng(0).standard_normal((4, 6))
    assert layer.forward(x, Context(train=False)) is x
    assert layer.backward(x) is x
    y = layer.forward(x, Context(train=True, step=2, seed=1))
    y_ids = layer.forward(x, Context(train=True, step=2, seed=1, sample_ids=np.arange(4)))
    np.testing.assert_array_equal(y, y_ids)
    with pytest.raises(ValueError):
        Dropout(1.0)


def test_dropout_without_a_step_draws_new_masks_each_training_pass():
    """``Context(train=True)`` in a hand-written loop (the README's) keyed every step's mask
    with step 0: one mask for the whole run. The layer now counts its own passes."""
    backend = get_backend("numpy", "float64")
    layer = Dropout(0.5)
    Sequential([layer]).build((64,), backend, 0)
    x = np.ones((4, 64))
    first = layer.forward(x, Context(train=True)).copy()
    second = layer.forward(x, Context(train=True)).copy()
    assert not np.array_equal(first, second)
    layer.forward(x, Context(train=False))  # evaluation is not a training pass
    third = layer.forward(x, Context(train=True))
    for step, got in enumerate((first, second, third)):
        np.testing.assert_array_equal(got, layer.forward(x, Context(train=True, step=step)))


# -- buffers -----------------------------------------------------------------------------------
def test_conv_reuses_its_column_buffers_per_batch_size():
    backend = get_backend("numpy", "float32")
    conv = Conv2D(4, 3)
    Sequential([conv]).build((2, 6, 6), backend, 0)
    x = np.ones((8, 2, 6, 6), np.float32)
    conv.forward(x, Context())
    cols = conv.cols
    conv.backward(np.ones((8, 4, 4, 4), np.float32))
    conv.forward(x, Context())
    assert np.shares_memory(conv.cols, cols) and conv.cols.shape == cols.shape
    conv.forward(x[:3], Context())  # the last, smaller batch of an epoch: the same memory
    assert np.shares_memory(conv.cols, cols) and conv.cols.shape[1] == 3 * 16
    conv.forward(x, Context())
    assert np.shares_memory(conv.cols, cols) and conv.cols.shape == cols.shape
    assert len(conv._buffers) == 2 and conv._buffers[0].size == cols.size  # one (cols, gemm)
