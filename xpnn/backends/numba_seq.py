"""Numba kernel bodies of sequence models, compiled in ``numba_kernels``: the causal softmax and
its backward, layer normalisation, the GELU, a bias gradient's column sums, a scatter-add."""

import math
from typing import Any

import numpy as np
from numba import njit, prange

from xpnn.backends.kernels import GELU_A, GELU_C
from xpnn.backends.numba_jit import JIT


def causal_shift_pack(s, pk, scale, ninf):  # pragma: no cover - compiled
    """``z[j] - max(z[:i+1])`` (``j <= i``, else -inf) of ``z = s * scale`` (N, T, T), packed for
    NumPy's SIMD ``exp`` to take the seen half alone: ``min(T, g + 8)`` values a row of a group of
    8. Loops over 1-D rows: 3-D indexing kept LLVM from vectorising (3x slower)."""
    n, t, _ = s.shape
    o = 0
    for b in range(n):
        for g in range(0, t, 8):
            w = min(t, g + 8)
            for i in range(g, min(t, g + 8)):
                row, out = s[b, i], pk[o : o + w]
                m = row[0] * scale
                for j in range(1, i + 1):
                    z = row[j] * scale
                    m = z if z > m else m
                for j in range(w):
                    z = row[j] * scale - m
                    out[j] = z if j <= i else ninf
                o += w
    return o


def causal_normalise_unpack(pk, ones, p):  # pragma: no cover - compiled
    """``p[b, i] = e / sum(e)`` of ``causal_shift_pack``'s rows once ``pk`` holds their ``exp``,
    0 after; the sum grouped as NumPy groups a row (the masked zeros change none of its sums)."""
    n, t, _ = p.shape
    o = 0
    for b in range(n):
        for g in range(0, t, 8):
            w = min(t, g + 8)
            for i in range(g, min(t, g + 8)):
                e, row = pk[o : o + w], p[b, i]
                total = _row_dot8(e, ones[:w])
                for j in range(w):
                    row[j] = e[j] / total
                row[w:] = 0.0
                o += w
    return p


def causal_softmax_backward(dp, p, ds, scale):  # pragma: no cover - compiled
    """``ds = p (dp - sum(dp p)) scale`` by rows, 0 past each row's group of 8 (as ``p``), summed
    as NumPy sums the row. ``dp`` is first copied into ``ds``: two views of a row failed the
    loop's alias check and ran scalar (0.10-0.13 against 0.06-0.09 ms over 64x64x64 float32)."""
    if dp.ctypes.data != ds.ctypes.data:
        ds[...] = dp
    n, t, _ = p.shape
    for b in range(n):
        for g in range(0, t, 8):
            w = min(t, g + 8)
            for i in range(g, min(t, g + 8)):
                row, prob = ds[b, i], p[b, i, :w]
                dot = _row_dot8(row[:w], prob)
                for j in range(w):
                    row[j] = prob[j] * (row[j] - dot) * scale
                row[w:] = 0.0
    return ds


def embedding_grad(ids, dy, out):  # pragma: no cover - compiled
    """Rows in order, as ``np.add.at`` adds them: the same bits."""
    out[...] = 0
    n, d = dy.shape
    for i in range(n):
        row = ids[i]
        for j in range(d):
            out[row, j] += dy[i, j]
    return out


def gelu_inner(x, t, c, a):  # pragma: no cover - compiled
    """``t = c (x + a x^3)`` in the generic formula's order: NumPy's ``tanh`` of it, its bits."""
    for i in range(x.size):
        v = x[i]
        t[i] = c * (v + a * v * v * v)


# Eigen's float ``tanh`` (the rational approximation PyTorch's CPU kernels vectorise), odd
# numerator 13th degree, even denominator 6th, exact to a few float32 ulp, clamped where it is 1
_TANH_P = (-2.76076847742355e-16, 2.00018790482477e-13, -8.60467152213735e-11,
           5.12229709037114e-08, 1.48572235717979e-05, 6.37261928875436e-04,
           4.89352455891786e-03)  # fmt: skip
_TANH_Q = (1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03,
           4.89352518554385e-03)  # fmt: skip
TANH_F32 = np.array((7.90531110763549805, *_TANH_P, *_TANH_Q), dtype=np.float32)


def bias_gelu_f32(z, b, y, k, c, a):  # pragma: no cover - compiled
    """``z += b``, ``y = gelu(z)`` in one pass, ``tanh`` by ``k`` (``TANH_F32``), which LLVM
    vectorises (0.15 against 0.35 ms over (1024, 512)); no ``t`` kept: cheaper computed again."""
    n, m = z.shape
    half, one = np.float32(0.5), np.float32(1.0)
    for i in range(n):
        row, out = z[i], y[i]
        for j in range(m):
            v = row[j] + b[j]
            row[j] = v
            out[j] = half * v * (one + _tanh_f32(c * (v + a * v * v * v), k))


@njit(**JIT, inline="always")
def _tanh_f32(u, k):  # pragma: no cover - compiled
    """``tanh(u)`` of a float32 by ``TANH_F32``'s rational approximation."""
    lim, p13, p11, p9, p7, p5, p3, p1, q6, q4, q2, q0 = k
    u = min(max(u, -lim), lim)
    u2 = u * u
    p = ((((((p13 * u2 + p11) * u2 + p9) * u2 + p7) * u2 + p5) * u2 + p3) * u2 + p1) * u
    return p / (((q6 * u2 + q4) * u2 + q2) * u2 + q0)


def gelu_outer(x, t, y, half, one):  # pragma: no cover - compiled
    """``y = x/2 (1 + t)`` once ``t`` holds the ``tanh`` (``half``, ``one`` in the dtype)."""
    for i in range(x.size):
        y[i] = half * x[i] * (one + t[i])


def gelu_grad_constants(dtype: Any) -> tuple:
    """``gelu_backward``'s constants in ``dtype``, as NumPy rounds the generic formula's."""
    kind = np.dtype(dtype).type
    return kind(GELU_C), kind(3.0 * GELU_A), kind(0.5), kind(1.0)


def gelu_backward(dy, x, t, dx, c, c3a, half, one):  # pragma: no cover - compiled
    """``Kernels.gelu_backward`` in one pass, constants in the arrays' dtype: a float64 one runs
    a float32 pass in float64 (0.12 against 0.096 ms for 512K values, and other bits)."""
    for i in prange(x.size):
        dx[i] = _gelu_grad(dy[i], x[i], t[i], c, c3a, half, one)


def bias_gelu_backward_f32(dy, x, k, c, a, c3a, chunks):  # pragma: no cover - compiled
    """``bias_gelu_f32``'s backward over ``dy``, the bias gradient summed while a row is cached."""
    n, m = dy.shape
    partial = np.zeros((chunks, m), dtype=dy.dtype)
    step = (n + chunks - 1) // chunks
    half, one = np.float32(0.5), np.float32(1.0)
    for r in prange(chunks):
        acc = partial[r]
        for i in range(r * step, min(n, (r + 1) * step)):
            g, xr = dy[i], x[i]
            for j in range(m):
                v = xr[j]
                th = _tanh_f32(c * (v + a * v * v * v), k)
                d = _gelu_grad(g[j], v, th, c, c3a, half, one)
                g[j] = d
                acc[j] += d
    return summed(partial)


@njit(**JIT, inline="always")
def _gelu_grad(g, v, th, c, c3a, half, one):  # pragma: no cover - compiled
    """One value of ``Kernels.gelu_backward``, in its order of operations."""
    inner = c * (one + c3a * v * v)
    return g * (half * (one + th) + half * v * (one - th * th) * inner)


def column_sums(dy, chunks):  # pragma: no cover - compiled
    """An identity layer's bias gradient: ``dy``'s column sums, in row order within each task."""
    n, m = dy.shape
    partial = np.zeros((chunks, m), dtype=dy.dtype)
    step = (n + chunks - 1) // chunks
    for k in prange(chunks):
        acc = partial[k]
        for i in range(k * step, min(n, (k + 1) * step)):
            g = dy[i]
            for j in range(m):
                acc[j] += g[j]
    return summed(partial)


@njit(**JIT, inline="always")
def summed(partial):  # pragma: no cover - compiled
    """The tasks' partial column sums added in task order."""
    out = partial[0].copy()
    for k in range(1, partial.shape[0]):
        out += partial[k]
    return out


# inlined where called: called once a row of up to 128 values, the call cost as much as its
# loop (0.38 against 0.17 ms over the GPT's 8,192 rows of attention)
@njit(**JIT, inline="always")
def _row_dot8(u, v):  # pragma: no cover - compiled
    """``sum(u * v)`` in 8 interleaved partial sums: one chain of adds runs several times slower;
    this order is as fixed as that one, unlike ``fastmath``'s reassociation."""
    z = u[0] - u[0]  # a zero of the arrays' dtype: float32 stays float32
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = z
    full = u.size - u.size % 8
    for j in range(0, full, 8):
        s0 += u[j] * v[j]
        s1 += u[j + 1] * v[j + 1]
        s2 += u[j + 2] * v[j + 2]
        s3 += u[j + 3] * v[j + 3]
        s4 += u[j + 4] * v[j + 4]
        s5 += u[j + 5] * v[j + 5]
        s6 += u[j + 6] * v[j + 6]
        s7 += u[j + 7] * v[j + 7]
    total = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
    for j in range(full, u.size):
        total += u[j] * v[j]
    return total


def layer_norm(x, gamma, beta, ones, consts, y, xhat, inv_std):  # pragma: no cover - compiled
    """``Kernels.layer_norm`` of rows; ``consts`` (1/D, eps) in their dtype, not to promote
    float32. 1-D rows and the sums inlined: 0.071 against 0.097 ms over (1024, 128) float32."""
    n, d = x.shape
    inv_d, eps = consts[0], consts[1]
    for i in prange(n):
        row, h, out = x[i], xhat[i], y[i]
        mean = _row_dot8(row, ones) * inv_d
        for j in range(d):
            h[j] = row[j] - mean
        inv = ones[0] / math.sqrt(_row_dot8(h, h) * inv_d + eps)
        inv_std[i] = inv
        for j in range(d):
            v = h[j] * inv
            h[j] = v
            out[j] = v * gamma[j] + beta[j]


def layer_norm_input_grad(dy, xhat, inv_std, gamma, ones, consts, dx):  # pragma: no cover
    """dL/dx of ``layer_norm`` over rows (N, D); ``ones`` and ``consts`` as there."""
    for i in prange(dy.shape[0]):
        _row_input_grad(dy[i], xhat[i], inv_std[i], gamma, ones, consts[0], dx[i])


def layer_norm_param_grads(dy, xhat, dgamma, dbeta):  # pragma: no cover - compiled
    """``dgamma`` and ``dbeta`` of ``layer_norm``: column sums over the rows, in row order."""
    n, d = dy.shape
    dgamma[:] = 0
    dbeta[:] = 0
    for i in range(n):
        for j in range(d):
            dgamma[j] += dy[i, j] * xhat[i, j]
            dbeta[j] += dy[i, j]


def layer_norm_backward(
    dy, xhat, inv_std, gamma, ones, consts, dx, dgamma, dbeta
):  # pragma: no cover
    """``layer_norm_param_grads`` and ``layer_norm_input_grad`` in one serial pass, their sums'
    order: ``dy``, ``xhat`` read once, 0.12 against 0.17 ms over (1024, 128) float32, cold."""
    n, d = dy.shape
    dgamma[:] = 0
    dbeta[:] = 0
    for i in range(n):
        g, h = dy[i], xhat[i]
        for j in range(d):
            dgamma[j] += g[j] * h[j]
            dbeta[j] += g[j]
        _row_input_grad(g, h, inv_std[i], gamma, ones, consts[0], dx[i])


@njit(**JIT, inline="always")
def _row_input_grad(g, h, inv, gamma, ones, inv_d, out):  # pragma: no cover - compiled
    """One row of ``layer_norm``'s dL/dx: ``(g gamma - mean(g gamma) - h mean(g gamma h)) inv``."""
    for j in range(g.size):
        out[j] = g[j] * gamma[j]
    mean_g = _row_dot8(out, ones) * inv_d
    mean_gx = _row_dot8(out, h) * inv_d
    for j in range(g.size):
        out[j] = (out[j] - mean_g - h[j] * mean_gx) * inv
