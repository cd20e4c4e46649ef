"""CuPy convolution, pooling and dropout kernels and layers against NumPy's (float64).

Skipped, with the reason, where CuPy or a CUDA device is missing.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import cnn_preset_step, cupy_or_skip

pytestmark = pytest.mark.gpu

cp = cupy_or_skip()

from xpnn.backends import get_backend  # noqa: E402
from xpnn.backends.numpy_kernels import NumpyKernels  # noqa: E402
from xpnn.nn import Context, Sequential  # noqa: E402
from xpnn.nn.conv import Conv2D  # noqa: E402
from xpnn.nn.dropout import Dropout  # noqa: E402
from xpnn.nn.pool import MaxPool2D  # noqa: E402

RTOL = 1e-9  # cuBLAS and the GPU reductions sum in other orders than BLAS/NumPy


@pytest.fixture(scope="module")
def kernels():
    from xpnn.backends.cupy_kernels import CupyKernels

    return CupyKernels(cp), NumpyKernels(np)


GEOMETRIES = [
    (2, 3, 7, 6, 3, 2, 1, 0),
    (3, 2, 9, 8, 3, 3, 2, 1),
    (2, 1, 5, 5, 2, 3, 3, 2),
    (4, 32, 13, 13, 3, 3, 1, 0),
]


@pytest.mark.parametrize("geom", GEOMETRIES)
def test_im2col_and_col2im_equal_numpy(kernels, geom):
    gpu, ref = kernels
    n, c, h, w, kh, kw, s, p = geom
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, c, h, w))
    cols = ref.im2col(x, kh, kw, s, p)
    np.testing.assert_array_equal(cp.asnumpy(gpu.im2col(cp.asarray(x), kh, kw, s, p)), cols)
    d = rng.standard_normal(cols.shape)
    dx = ref.col2im(d.copy(), x.shape, kh, kw, s, p)
    got = cp.asnumpy(gpu.col2im(cp.asarray(d), x.shape, kh, kw, s, p))
    np.testing.assert_allclose(got, dx, rtol=1e-14, atol=1e-15)


def test_im2col_and_col2im_with_out_hw_equal_numpy(kernels):
    gpu, ref = kernels
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 4, 11, 11))
    cols = ref.im2col(x, 3, 3, 1, 0, out_hw=(8, 7))
    got = gpu.im2col(cp.asarray(x), 3, 3, 1, 0, out_hw=(8, 7))
    np.testing.assert_array_equal(cp.asnumpy(got), cols)
    d = rng.standard_normal(cols.shape)
    dx = ref.col2im(d.copy(), x.shape, 3, 3, 1, 0, out_hw=(8, 7))
    got = cp.asnumpy(gpu.col2im(cp.asarray(d), x.shape, 3, 3, 1, 0, out_hw=(8, 7)))
    np.testing.assert_allclose(got, dx, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("size, stride", [(2, 2), (3, 2), (2, 1), (2, 3)])
def test_maxpool_equals_numpy(kernels, size, stride):
    gpu, ref = kernels
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 4, 9, 8))
    y, idx = ref.maxpool2d_forward(x, size, stride)
    gy, gidx = gpu.maxpool2d_forward(cp.asarray(x), size, stride)
    np.testing.assert_array_equal(cp.asnumpy(gy), y)
    np.testing.assert_array_equal(cp.asnumpy(gidx), idx)
    dy = rng.standard_normal(y.shape)
    dx = ref.maxpool2d_backward(dy, idx, x.shape, size, stride)
    got = gpu.maxpool2d_backward(cp.asarray(dy), gidx, x.shape, size, stride)
    np.testing.assert_allclose(cp.asnumpy(got), dx, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_dropout_masks_are_bit_identical_to_numpy(kernels, dtype):
    gpu, ref = kernels
    ids = np.array([3, 10, 2**40 + 5, 0, 77, -5, 123456, 9])
    for p in (0.0, 0.3, 0.5, 0.9):
        want = ref.dropout_mask((8, 3, 5), p, 2**35 + 7, 12, ids, np.dtype(dtype), 2)
        got = gpu.dropout_mask((8, 3, 5), p, 2**35 + 7, 12, cp.asarray(ids), np.dtype(dtype), 2)
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(cp.asnumpy(got), want)


def _layer_run(backend, make, in_shape, batch=4):
    layer = make()
    Sequential([layer]).build(in_shape, backend, 0)
    rng = np.random.default_rng(10)
    x = backend.asarray(rng.standard_normal((batch, *in_shape)))
    ids = backend.asarray(np.arange(100, 100 + batch), dtype=backend.xp.int64)
    y = layer.forward(x, Context(train=True, step=1, seed=3, sample_ids=ids))
    dx = layer.backward(backend.asarray(rng.standard_normal(y.shape)), need_dx=True)
    out = {"y": backend.to_host(y), "dx": backend.to_host(dx)}
    out.update({k: backend.to_host(g).copy() for k, g in layer.grads.items()})
    return out


@pytest.mark.parametrize(
    "make, in_shape",
    [
        (lambda: Conv2D(5, 3), (3, 9, 8)),
        (lambda: Conv2D(4, (2, 3), stride=2, padding=1), (2, 9, 10)),
        (lambda: MaxPool2D(2), (3, 9, 7)),
        (lambda: MaxPool2D(3, stride=2), (2, 9, 8)),
        (lambda: Dropout(0.3), (3, 4, 5)),
    ],
)
def test_cupy_layers_equal_numpy(make, in_shape):
    ref = _layer_run(get_backend("numpy", "float64"), make, in_shape)
    got = _layer_run(get_backend("cupy", "float64"), make, in_shape)
    for key in ref:
        np.testing.assert_allclose(got[key], ref[key], rtol=RTOL, atol=1e-12, err_msg=key)


def test_cnn_preset_on_cupy_equals_numpy():
    _, _, loss_ref, grads_ref = cnn_preset_step(get_backend("numpy", "float64"))
    _, _, loss, grads = cnn_preset_step(get_backend("cupy", "float64"))
    np.testing.assert_allclose(loss, loss_ref, rtol=RTOL)
    np.testing.assert_allclose(grads, grads_ref, rtol=RTOL, atol=1e-12)
