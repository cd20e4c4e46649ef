"""The Numba backend's causal attention: the softmax over each row's seen chunks of 8 keys
(the rest never read), against the array-API formulas every other backend runs."""

import numpy as np
import pytest

from xpnn.backends import get_backend
from xpnn.backends import numba_kernels as nk
from xpnn.backends.kernels import Kernels


def _inputs(shape, dtype, seed=4):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(shape).astype(dtype) for _ in range(4))


@pytest.mark.parametrize("t", [5, 8, 33, 64, 70, 130])  # chunks whole and partial, > 128
def test_attention_and_its_backward_equal_the_generic_formulas_in_float64(t):
    ref, got = get_backend("numpy", "float64").kernels, get_backend("numba", "float64").kernels
    q, k, v, dout = _inputs((2, 3, t, 4), "float64")
    out, p = got.causal_attention(q, k, v, 0.5)
    out_ref, p_ref = Kernels.causal_attention(ref, q, k, v, 0.5)
    np.testing.assert_allclose(p, p_ref, rtol=1e-12, atol=1e-15)
    assert np.all(p[..., np.triu(np.ones((t, t), bool), 1)] == 0)  # the future, exactly
    np.testing.assert_allclose(out, out_ref, rtol=1e-12, atol=1e-14)
    grads = got.causal_attention_backward(dout, q, k, v, p_ref, 0.5)
    expected = Kernels.causal_attention_backward(ref, dout, q, k, v, p_ref, 0.5)
    for g, g_ref in zip(grads, expected, strict=True):
        np.testing.assert_allclose(g, g_ref, rtol=1e-10, atol=1e-13)


def test_the_softmax_reads_nothing_past_a_rows_seen_chunks():
    """Values past each row's chunks of 8 keys (here NaN) reach neither the probabilities nor
    the backward's gradient: the kernels never read them."""
    t = 20
    s, dp = _inputs((3, t, t), "float64", seed=5)[:2]
    width = np.array([min(t, (i // 8 + 1) * 8) for i in range(t)])
    unread = np.arange(t)[None, :] >= width[:, None]
    ref = Kernels.causal_softmax(get_backend("numpy", "float64").kernels, s)
    p = np.empty_like(s)
    nk._causal_softmax_into(np.where(unread, np.nan, s), p)
    np.testing.assert_allclose(p, ref, rtol=1e-14)
    ds = np.where(unread, np.nan, dp)
    nk._causal_softmax_backward(ds, ref, ds, 1.0)
    np.testing.assert_allclose(ds, ref * (dp - np.sum(dp * ref, -1, keepdims=True)), atol=1e-15)


def test_a_nan_score_turns_its_row_nan_as_numpy_does():
    s = _inputs((1, 9, 9), "float32")[0]
    s[0, 4, 2] = np.nan
    p = get_backend("numba", "float32").kernels.causal_softmax(s)
    assert np.isnan(p[0, 4, :5]).all() and np.isfinite(np.delete(p[0], 4, axis=0)).all()
