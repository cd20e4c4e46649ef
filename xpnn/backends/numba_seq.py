"""Numba kernel bodies of sequence models, compiled in ``numba_kernels``: attention's causal
softmax in one pass over each row's seen half (NumPy makes five passes over the whole score
matrix) and an embedding's scatter-add."""

from __future__ import annotations

import math

from numba import prange


def causal_softmax(s, p):  # pragma: no cover - compiled
    """``p[b, i, :i+1]`` = softmax of ``s[b, i, :i+1]``; the rest of row ``i`` is 0."""
    n, t, _ = s.shape
    for r in prange(n * t):
        b, i = r // t, r % t
        m = s[b, i, 0]
        for j in range(1, i + 1):
            if s[b, i, j] > m:
                m = s[b, i, j]
        total = 0.0
        for j in range(i + 1):
            e = math.exp(s[b, i, j] - m)
            p[b, i, j] = e
            total += e
        for j in range(i + 1):
            p[b, i, j] = p[b, i, j] / total
        for j in range(i + 1, t):
            p[b, i, j] = 0.0
    return p


def causal_softmax_backward(dp, p, ds):  # pragma: no cover - compiled
    n, t, _ = p.shape
    for r in prange(n * t):
        b, i = r // t, r % t
        dot = 0.0
        for j in range(i + 1):
            dot += dp[b, i, j] * p[b, i, j]
        for j in range(i + 1):
            ds[b, i, j] = p[b, i, j] * (dp[b, i, j] - dot)
        for j in range(i + 1, t):
            ds[b, i, j] = 0.0
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


def gelu(x, y, t):  # pragma: no cover - compiled
    """``Kernels.gelu`` over flat ``x`` in one pass, ``y`` and ``t`` written."""
    c, a = math.sqrt(2.0 / math.pi), 0.044715
    for i in prange(x.size):
        v = x[i]
        th = math.tanh(c * (v + a * v * v * v))
        t[i] = th
        y[i] = 0.5 * v * (1.0 + th)


def gelu_backward(dy, x, t, dx):  # pragma: no cover - compiled
    """``Kernels.gelu_backward`` over flat arrays in one pass."""
    c, a = math.sqrt(2.0 / math.pi), 0.044715
    for i in prange(x.size):
        v, th = x[i], t[i]
        inner = c * (1.0 + 3.0 * a * v * v)
        dx[i] = dy[i] * (0.5 * (1.0 + th) + 0.5 * v * (1.0 - th * th) * inner)
