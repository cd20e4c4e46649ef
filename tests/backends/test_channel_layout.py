"""Numba keeps a convolution's output where its GEMM wrote it, (C, N, H, W) in memory behind an
(N, C, H, W) view: 2x2 pooling reads that view in place and writes its input gradient in the
same layout, and the convolution's backward forms dL/dz in that gradient's memory. Each result
equals the NumPy reference's, whatever the layout it arrives in."""

import numpy as np
import pytest

from xpnn.backends import get_backend

SHAPE = (5, 3, 8, 7)  # (N, C, H, W): odd widths leave a column no 2x2 window covers


def _kernels(name):
    return get_backend(name, "float64").kernels


def _by_channel(a):
    """``a``'s values in an (N, C, H, W) view of (C, N, H, W) memory."""
    return np.ascontiguousarray(a.transpose(1, 0, 2, 3)).transpose(1, 0, 2, 3)


def test_conv_output_is_a_view_of_the_gemm_result_equal_to_the_reference():
    n, c, h, w = SHAPE
    rng = np.random.default_rng(0)
    yc, b = rng.standard_normal((c, n * h * w)), rng.standard_normal(c)
    want = _kernels("numpy").conv_output(yc.copy(), b, SHAPE, "relu")
    z = yc.copy()
    got = _kernels("numba").conv_output(z, b, SHAPE, "relu")
    assert np.shares_memory(got, z)  # no second output array
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("act", ["relu", "identity", "tanh"])
@pytest.mark.parametrize("layout", ["by_channel", "by_sample"])
def test_conv_output_grad_equals_the_reference_and_leaves_the_output_alone(act, layout):
    n, c, h, w = SHAPE
    rng = np.random.default_rng(1)
    numba = _kernels("numba")
    z = rng.standard_normal((c, n * h * w))
    y = numba.conv_output(z, rng.standard_normal(c), SHAPE, act)
    kept = y.copy()
    dy = rng.standard_normal(SHAPE)
    want, want_db = _kernels("numpy").conv_output_grad(dy.copy(), None, kept, act)
    given = _by_channel(dy) if layout == "by_channel" else dy.copy()
    got, db = numba.conv_output_grad(given, z, y, act)  # ``z``: the GEMM buffer, as Conv2D
    np.testing.assert_allclose(got, want, rtol=1e-15, atol=0)
    np.testing.assert_allclose(db, want_db, rtol=1e-12)
    np.testing.assert_array_equal(y, kept)  # the layer's output survives its backward
    assert np.shares_memory(got, given) == (layout == "by_channel")  # in place, or a new array


@pytest.mark.parametrize("layout", ["by_channel", "by_sample"])
def test_2x2_pooling_of_either_layout_equals_the_reference_and_keeps_its_layout(layout):
    x = np.random.default_rng(2).standard_normal(SHAPE)
    x[0, 1, 2, 2] = x[3, 2, 4, 5] = np.nan  # the first NaN of a window wins, as in NumPy
    want_y, want_idx = _kernels("numpy").maxpool2d_forward(x, 2, 2)
    given = _by_channel(x) if layout == "by_channel" else x.copy()
    y, idx = _kernels("numba").maxpool2d_forward(given, 2, 2)
    np.testing.assert_array_equal(y, want_y)
    np.testing.assert_array_equal(idx, want_idx)
    assert y.flags.c_contiguous  # what the next layer reads
    dy = np.random.default_rng(3).standard_normal(y.shape)
    want_dx = _kernels("numpy").maxpool2d_backward(dy, want_idx, SHAPE, 2, 2)
    dx = _kernels("numba").maxpool2d_backward(dy, idx, SHAPE, 2, 2)
    np.testing.assert_array_equal(dx, want_dx)
    assert dx.strides == given.strides  # the input's layout: the convolution reads it in place
