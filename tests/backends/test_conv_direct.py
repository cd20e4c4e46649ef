"""The direct convolution (``Kernels.conv_direct``: few input channels, no batch-sized columns):
Numba's kernels equal the array-API reference (im2col and one GEMM) and finite differences,
their serial and parallel builds agree bit for bit, and ``Conv2D`` takes the path only where
the backend says it pays."""

import numpy as np
import pytest

from xpnn.backends import get_backend
from xpnn.backends import numba_conv as conv
from xpnn.backends.kernels import Kernels
from xpnn.backends.numba_jit import ACT_CODE
from xpnn.backends.numba_kernels import NumbaKernels
from xpnn.nn import Context, Sequential
from xpnn.nn.conv import Conv2D
from xpnn.testing import numeric_grad

# (N, C_in, H, W, C_out, kh, kw, stride, padding, out_hw or None: all the outputs)
GEOMETRIES = [
    (5, 1, 28, 28, 32, 3, 3, 1, 0, None),  # the CNN's first layer: the 9-tap passes
    (3, 1, 9, 9, 4, 3, 3, 1, 0, (6, 5)),  # 9 taps, fewer outputs than the input allows
    (3, 2, 7, 6, 3, 2, 3, 2, 1, None),  # strided, padded, 12 taps
    (2, 1, 5, 5, 3, 1, 1, 1, 2, None),  # padding wider than the kernel
    (4, 3, 6, 7, 2, 2, 2, 1, 1, None),  # 12 taps over three channels
]
ACTS = ["identity", "relu", "sigmoid", "tanh"]


def _case(geometry, dtype, seed=0):
    n, c, h, w, co, kh, kw, s, p, out_hw = geometry
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w)).astype(dtype)
    wt = rng.standard_normal((co, c, kh, kw)).astype(dtype)
    b = rng.standard_normal(co).astype(dtype)
    full = ((h + 2 * p - kh) // s + 1, (w + 2 * p - kw) // s + 1)
    return x, wt, b, s, p, out_hw or full


def _run(kernels, x, wt, b, s, p, out_hw, act, need_dx=True):
    y = kernels.conv_direct(x, wt, b, s, p, out_hw, act)
    dy = np.random.default_rng(1).standard_normal(y.shape).astype(x.dtype)
    dw = np.full(wt.shape, np.nan, dtype=x.dtype)  # a kernel that writes nothing fails
    db, dx = kernels.conv_direct_backward(dy, x, y, wt, s, p, act, dw, need_dx)
    return {"y": y, "dw": dw, "db": db, "dx": dx}


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_numba_direct_convolution_equals_the_reference(geometry, act, dtype):
    case = _case(geometry, dtype)
    ref = _run(Kernels(np), *case, act)
    got = _run(NumbaKernels(np), *case, act)
    tol = {"rtol": 1e-10, "atol": 1e-12} if dtype == np.float64 else {"rtol": 2e-5, "atol": 2e-5}
    for key in ref:
        assert got[key].shape == ref[key].shape
        assert np.all(np.isfinite(got[key])), key
        np.testing.assert_allclose(got[key], ref[key], err_msg=key, **tol)
    assert NumbaKernels(np).conv_direct_backward(
        np.ones_like(ref["y"]), case[0], ref["y"], case[1], *case[3:5], act,
        np.empty_like(case[1]), need_dx=False,
    )[1] is None  # fmt: skip


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_serial_and_parallel_builds_agree_bit_for_bit(geometry):
    x, wt, b, s, p, out_hw = _case(geometry, np.float32, seed=2)
    co, _, kh, kw = wt.shape
    w2 = wt.reshape(co, -1)
    code = ACT_CODE["tanh"]
    outs = []
    for fwd, bwd in (
        (conv.conv_direct.serial, conv.conv_direct_backward.serial),
        (conv.conv_direct.parallel, conv.conv_direct_backward.parallel),
    ):
        y = np.full((x.shape[0], co, *out_hw), np.nan, dtype=x.dtype)
        fwd(x, w2, b, kh, kw, s, p, y, 3, code)
        dy = np.random.default_rng(3).standard_normal(y.shape).astype(x.dtype)
        dx = np.full(x.shape, np.nan, dtype=x.dtype)
        pdw, pdb = np.zeros((3, *w2.shape), x.dtype), np.zeros((3, co), x.dtype)
        bwd(dy, x, y, w2, kh, kw, s, p, code, dx, pdw, pdb)
        outs.append((y, dx, pdw, pdb))
    for a, b_ in zip(*outs, strict=True):
        assert np.all(np.isfinite(a))
        np.testing.assert_array_equal(a, b_)


@pytest.mark.parametrize(
    "make, in_shape",
    [
        (lambda: Conv2D(3, 3, stride=2, padding=1, activation="tanh"), (1, 7, 6)),
        (lambda: Conv2D(2, 2, padding=1, activation="sigmoid"), (2, 4, 5)),
    ],
)
def test_numba_direct_convolution_matches_finite_differences(make, in_shape):
    backend = get_backend("numba", "float64")
    layer = make()
    Sequential([layer]).build(in_shape, backend, 0)
    assert backend.kernels.conv_direct_pays(in_shape[0], layer.kh, layer.kw, layer.stride)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, *in_shape))
    r = rng.standard_normal(layer.forward(x, Context()).shape)

    def f() -> float:
        return float(np.sum(layer.forward(x, Context()) * r))

    f()
    dx = layer.backward(r.copy(), need_dx=True)
    assert layer._buffers is None  # the direct path: no columns
    grads = {k: g.copy() for k, g in layer.grads.items()}
    np.testing.assert_allclose(dx, numeric_grad(f, x), rtol=1e-6, atol=1e-8)
    for name, g in grads.items():
        np.testing.assert_allclose(g, numeric_grad(f, layer.params[name]), rtol=1e-6, atol=1e-8)


def test_conv2d_takes_the_direct_path_only_where_the_backend_says_it_pays():
    backend = get_backend("numba", "float32")
    rng = np.random.default_rng(5)
    few = Sequential([Conv2D(4, 3)]).build((1, 8, 8), backend, 0)  # 9 taps
    many = Sequential([Conv2D(4, 3)]).build((2, 8, 8), backend, 0)  # 18 taps: im2col
    for model, c in ((few, 1), (many, 2)):
        model.forward(rng.random((2, c, 8, 8), dtype=np.float32), Context())
    assert few.layers[0]._buffers is None and few.layers[0].x is not None
    assert many.layers[0]._buffers is not None and many.layers[0].x is None
    assert not Kernels(np).conv_direct_pays(1, 3, 3, 1)  # the array API: im2col and a GEMM


@pytest.mark.parametrize(
    "shape, out_hw",
    [
        ((4, 5, 5, 5, 3, 3, 1), None),  # 3 wide: the offset-table path
        ((4, 5, 5, 5, 3, 3, 1), (2, 2)),  # what a floor-mode pool reads
        ((3, 2, 9, 8, 2, 3, 2), (3, 2)),  # strided
        ((2, 3, 13, 13, 3, 3, 1), (10, 10)),  # 10 wide: row by row
        ((2, 3, 12, 11, 3, 2, 1), None),  # 10 wide, every output: whole window rows
    ],
)
def test_numba_im2col_col2im_without_padding_equal_the_reference(shape, out_hw):
    n, c, h, w, kh, kw, s = shape
    rng = np.random.default_rng(7)
    x = rng.standard_normal((n, c, h, w))
    want = Kernels(np).im2col(x, kh, kw, s, 0, out_hw=out_hw)
    out = np.full(want.shape, np.nan)  # a kernel that writes nothing fails
    got = NumbaKernels(np).im2col(x, kh, kw, s, 0, out=out, out_hw=out_hw)
    np.testing.assert_array_equal(got, want)
    d = rng.standard_normal(want.shape)
    dx_want = Kernels(np).col2im(d, x.shape, kh, kw, s, 0, out_hw)
    dx = NumbaKernels(np).col2im(d.copy(), x.shape, kh, kw, s, 0, out_hw)
    np.testing.assert_allclose(dx, dx_want, rtol=1e-13, atol=1e-14)
    assert np.isclose(np.sum(want * d), np.sum(x * dx))  # the adjoint


@pytest.mark.parametrize("chunks", [1, 3, 7])
def test_kernels_whose_tasks_run_a_serial_body_cover_every_task(chunks):
    """im2col/col2im at stride 1 without padding and 2x2 pooling's backward: each parallel
    task calls a serial body on its share; every share is written, as the serial build does."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((5, 3, 12, 11)).astype(np.float32)
    builds = []
    for im2col, col2im, unpool in (
        (conv.im2col_valid.serial, conv.col2im_valid.serial, conv.maxpool2x2_backward.serial),
        (conv.im2col_valid.parallel, conv.col2im_valid.parallel, conv.maxpool2x2_backward.parallel),
    ):
        cols = im2col(x, 3, 2, 10, 10, np.full((18, 500), np.nan, np.float32), chunks)
        dx = col2im(cols * 2, np.full(x.shape, np.nan, np.float32), 3, 2, 10, 10, chunks)
        y, idx = NumbaKernels(np).maxpool2d_forward(x, 2, 2)
        dxp = unpool(y, idx, np.full(x.shape, np.nan, np.float32), chunks)
        builds.append((cols, dx, dxp))
    for a, b in zip(*builds, strict=True):
        assert np.all(np.isfinite(a))
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(builds[0][0], Kernels(np).im2col(x, 3, 2, 1, 0))
