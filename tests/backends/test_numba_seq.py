"""The sequence kernels' one-pass builds give the bits of the passes they fuse."""

import numpy as np
import pytest

from xpnn.backends import numba_kernels as nk


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_layer_norms_one_pass_backward_is_the_two_passes_bit_for_bit(dtype):
    rng = np.random.default_rng(3)
    rows, d = 37, 128  # the GPT's width: the sums' eight-way grouping in full
    x = (rng.standard_normal((rows, d)) * 3 + 1).astype(dtype)
    gamma, beta = rng.standard_normal(d).astype(dtype), rng.standard_normal(d).astype(dtype)
    dy = rng.standard_normal((rows, d)).astype(dtype)
    y, xhat, inv = nk.NumbaKernels(np).layer_norm(x, gamma, beta, 1e-5)
    ones, consts = nk._row_constants(dy, 0.0)
    want_dx, want_dg, want_db = np.empty_like(dy), np.empty_like(gamma), np.empty_like(gamma)
    nk._layer_norm_param_grads(dy, xhat, want_dg, want_db)
    nk._layer_norm_input_grad.serial(dy, xhat, inv.reshape(-1), gamma, ones, consts, want_dx)
    got = nk.NumbaKernels(np).layer_norm_backward(dy, xhat, inv, gamma, True)
    for a, b in zip(got, (want_dx, want_dg, want_db), strict=True):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(want_dg, 0) and not np.array_equal(want_dx, 0)
    none, dg, db = nk.NumbaKernels(np).layer_norm_backward(dy, xhat, inv, gamma, False)
    assert none is None
    np.testing.assert_array_equal(dg, want_dg)
    np.testing.assert_array_equal(db, want_db)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_gelus_backward_is_the_generic_formulas_bits(dtype):
    """Its constants in the arrays' dtype: a float32 pass is not run in float64."""
    from xpnn.backends import get_backend
    from xpnn.backends.kernels import Kernels

    rng = np.random.default_rng(4)
    x = (rng.standard_normal((64, 512)) * 3).astype(dtype)
    dy = rng.standard_normal((64, 512)).astype(dtype)
    ref = get_backend("numpy", np.dtype(dtype).name).kernels
    t = Kernels.gelu(ref, x)[1]
    got = nk.NumbaKernels(np).gelu_backward(dy, x, t)
    np.testing.assert_array_equal(got, Kernels.gelu_backward(ref, dy, x, t))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_causal_softmaxs_backward_in_place_is_the_same_bits(dtype):
    rng = np.random.default_rng(5)
    p = nk.NumbaKernels(np).causal_softmax(rng.standard_normal((6, 20, 20)).astype(dtype))
    dp = rng.standard_normal((6, 20, 20)).astype(dtype)
    scale = dtype(0.3)
    want = nk._causal_softmax_backward(dp, p, np.empty_like(p), scale)
    got = dp.copy()
    assert nk._causal_softmax_backward(got, p, got, scale) is got
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(want, 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_bias_gelu_epilogue_is_the_generic_bias_then_gelu(dtype, threads):
    """Forward: the bias pass's bits, then the GELU's (float64) or within a few ulp of them
    (float32: a rational ``tanh``, computed again backward); backward: the GELU's backward's
    bits (float64) or within a few ulp, its bias gradient the column sums within round-off
    (summed by chunks of rows)."""
    import numba

    from xpnn.backends import get_backend
    from xpnn.backends.kernels import Kernels

    rng = np.random.default_rng(6)
    z = (rng.standard_normal((1100, 512)) * 2).astype(dtype)  # past the parallel threshold
    b, dy = rng.standard_normal(512).astype(dtype), rng.standard_normal(z.shape).astype(dtype)
    ref = get_backend("numpy", np.dtype(dtype).name).kernels
    want = Kernels.bias_gelu(ref, z.copy(), b)
    want_dx, want_db = Kernels.bias_gelu_backward(ref, dy.copy(), want[0], want[2])
    numba.set_num_threads(threads)
    try:
        got = nk.NumbaKernels(np).bias_gelu(z.copy(), b)
        dx, db = nk.NumbaKernels(np).bias_gelu_backward(dy.copy(), want[0], got[2])
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    np.testing.assert_array_equal(got[0], want[0])
    if dtype == np.float64:
        np.testing.assert_array_equal(got[1], want[1])
        np.testing.assert_array_equal(got[2], want[2])
        np.testing.assert_array_equal(dx, want_dx)
    else:  # y to 4 ulp of its input's size, dx as a few ulp of tanh move it; no tanh kept
        assert got[2] is None
        x = want[0]
        np.testing.assert_array_less(np.abs(got[1] - want[1]), 4.8e-7 * np.abs(x) + 1e-30)
        np.testing.assert_array_less(np.abs(dx - want_dx), 1e-6 * np.abs(dy) * (1 + x * x))
    tol = 1e-6 * np.abs(dx).sum(axis=0) if dtype == np.float32 else 1e-13 * np.abs(dx).sum(axis=0)
    np.testing.assert_array_less(np.abs(db - want_db), tol)
    np.testing.assert_allclose(db, dx.astype(np.float64).sum(axis=0), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_identity_bias_gradient_reads_dy_and_leaves_it(threads):
    import numba

    rng = np.random.default_rng(7)
    dy = rng.standard_normal((1100, 512)).astype(np.float32)
    before = dy.copy()
    numba.set_num_threads(threads)
    try:
        dz, db = nk.NumbaKernels(np).bias_act_backward(dy, dy, "identity")
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    np.testing.assert_array_equal(dz, before)
    np.testing.assert_allclose(db, before.astype(np.float64).sum(axis=0), rtol=1e-4, atol=1e-4)
