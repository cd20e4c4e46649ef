"""Numba-compiled CPU kernels: one pass over memory where NumPy would make several.

Matrix products stay with BLAS (already optimal); what Numba fuses is the memory-bound glue
around them: bias + activation, the activation's derivative + the bias gradient, softmax +
cross-entropy + its gradient, and the optimizer updates. ``prange`` splits rows over the
rank's threads, as OpenMP does inside an MPI rank in C.

Two measured pitfalls shape this file (2-core machine, MLP 784-512-256-10, batch 128):
- Numba's OpenMP threads spin after a parallel region and starve OpenBLAS's threads: a
  128x784x512 product went from 1.4 ms to 11 ms when followed by a parallel kernel.
  ``OMP_WAIT_POLICY=PASSIVE`` (set before Numba starts its pool) removes that.
- Waking the thread team costs more than a serial pass over a small array. So every kernel
  is compiled twice and the parallel one runs only on big arrays: on 2 threads the Adam
  update broke even near 2**19 values (``bench/optimizer_step.py --params 524287``: serial
  145-152 us, ``--params 524288``: parallel 130-143 us; at 2**18 the serial loop won, 64-72 us
  against 105-112 us).
"""

from __future__ import annotations

import math
import os
import types

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from typing import Any

import numba as nb
import numpy as np
from numba import prange

from xpnn.backends.kernels import HostLabelChecks, NumpyKernels
from xpnn.backends.numba_conv import NumbaConvKernels
from xpnn.backends.numba_jit import ACT_CODE, JIT

Array = Any
PARALLEL_MIN_ELEMENTS = 1 << 19  # below this a serial loop beats waking the thread team


class _Twin:
    """A kernel compiled serial and parallel; calls pick by the size of the first argument."""

    def __init__(self, fn) -> None:  # noqa: ANN001
        self.serial = nb.njit(parallel=False, **JIT)(fn)
        self.parallel = nb.njit(parallel=True, **JIT)(renamed(fn, "_parallel"))

    def __call__(self, first, *args):  # noqa: ANN001, ANN204
        big = first.size >= PARALLEL_MIN_ELEMENTS
        return (self.parallel if big else self.serial)(first, *args)


def renamed(fn, suffix: str):  # noqa: ANN001, ANN201
    """A copy of ``fn`` under another qualified name. Numba's on-disk cache keys entries by
    qualified name and signature, not by compile flags: without this, the serial and the
    parallel build share one cache entry and whichever was compiled first serves both."""
    copy = types.FunctionType(
        fn.__code__, fn.__globals__, fn.__name__ + suffix, fn.__defaults__, fn.__closure__
    )
    copy.__qualname__ = fn.__qualname__ + suffix
    copy.__module__ = fn.__module__
    return copy


def twin(fn) -> _Twin:  # noqa: ANN001
    return _Twin(fn)


@twin
def _bias_act(z, b, act):  # pragma: no cover - compiled
    n, m = z.shape
    for i in prange(n):
        for j in range(m):
            v = z[i, j] + b[j]
            if act == 1:
                v = 0.0 if v <= 0 else v  # NaN stays NaN, as in NumPy
            elif act == 2:
                e = math.exp(-abs(v))
                v = 1.0 / (1.0 + e) if v >= 0 else e / (1.0 + e)
            elif act == 3:
                v = math.tanh(v)
            z[i, j] = v
    return z


@twin
def _bias_act_backward(dy, y, act, chunks):  # pragma: no cover - compiled
    """dz overwrites dy; per-chunk partial column sums keep the bias gradient parallel."""
    n, m = dy.shape
    partial = np.zeros((chunks, m), dtype=dy.dtype)
    step = (n + chunks - 1) // chunks
    for c in prange(chunks):
        for i in range(c * step, min(n, (c + 1) * step)):
            for j in range(m):
                g = dy[i, j]
                if act == 1:
                    g = g if y[i, j] > 0 else 0.0
                elif act == 2:
                    g = g * y[i, j] * (1.0 - y[i, j])
                elif act == 3:
                    g = g * (1.0 - y[i, j] * y[i, j])
                dy[i, j] = g
                partial[c, j] += g
    db = np.zeros(m, dtype=dy.dtype)
    for c in range(chunks):
        for j in range(m):
            db[j] += partial[c, j]
    return dy, db


@twin
def _softmax_xent(z, labels, scale):  # pragma: no cover - compiled
    n, k = z.shape
    grad = np.empty_like(z)
    loss = 0.0
    for i in prange(n):
        mx = z[i, 0]
        for j in range(1, k):
            mx = max(mx, z[i, j])
        s = 0.0
        for j in range(k):
            e = math.exp(z[i, j] - mx)
            grad[i, j] = e
            s += e
        loss += math.log(s) + mx - z[i, labels[i]]
        inv = 1.0 / s
        for j in range(k):
            grad[i, j] = grad[i, j] * inv * scale
        grad[i, labels[i]] -= scale
    return loss, grad


# The updates take the gradient as a tuple of equal buffers and sum them as they read them
# (``gs`` of one buffer is the usual case; ranks sharing memory pass one row per rank). A
# tuple, not a 2-D array: rows of a 2-D view are gathered element by element, and the loop
# loses its vectorisation (a measured 8x); a homogeneous tuple compiles once per length.
@twin
def _sgd(p, gs, lr):  # pragma: no cover - compiled
    for i in prange(p.size):
        gi = gs[0][i]
        for r in range(1, len(gs)):
            gi += gs[r][i]
        p[i] -= lr * gi


@twin
def _momentum(p, gs, v, lr, mu, tiny):  # pragma: no cover - compiled
    for i in prange(p.size):
        gi = gs[0][i]
        for r in range(1, len(gs)):
            gi += gs[r][i]
        vi = mu * v[i] + gi
        if -tiny < vi < tiny:  # subnormal: zero (Kernels.flush_subnormal says why)
            vi = tiny - tiny
        v[i] = vi
        p[i] -= lr * vi


@twin
def _adam(
    p, gs, m, v, lr_c1, beta1, beta2, one_m_b1, one_m_b2, eps, c2, tiny, root_tiny
):  # pragma: no cover
    """Every scalar arrives in the arrays' dtype: a float64 literal such as ``1.0 - beta1``
    (or a ``0.0``) would promote the float32 loop to float64 and cost it its vectorisation
    (4x here)."""
    for i in prange(p.size):
        gi = gs[0][i]
        for r in range(1, len(gs)):
            gi += gs[r][i]
        mi = beta1 * m[i] + one_m_b1 * gi
        # a square that would be subnormal (|g| < 1.1e-19 in float32) is 0: free in this loop,
        # and v moves by less than 1e-41 (NumPy's passes would pay a whole one for it)
        g2 = gi * gi if not -root_tiny < gi < root_tiny else tiny - tiny
        vi = beta2 * v[i] + one_m_b2 * g2
        if -tiny < mi < tiny:  # subnormal: zero (Kernels.flush_subnormal says why)
            mi = tiny - tiny
        if -tiny < vi < tiny:
            vi = tiny - tiny
        m[i] = mi
        v[i] = vi
        p[i] -= lr_c1 * (mi / (math.sqrt(vi / c2) + eps))


def _as_tuple(g: Any) -> tuple:
    return g if isinstance(g, tuple) else (g,)


class NumbaKernels(HostLabelChecks, NumbaConvKernels, NumpyKernels):
    """NumPy kernels with the memory-bound ones replaced by fused, threaded Numba loops."""

    def bias_act(self, z: Array, b: Array, act: str) -> Array:
        return _bias_act(z, b, ACT_CODE[act])

    def bias_act_backward(self, dy: Array, y: Array, act: str) -> tuple[Array, Array]:
        chunks = max(1, min(nb.get_num_threads(), dy.shape[0]))
        return _bias_act_backward(dy, y, ACT_CODE[act], chunks)

    def softmax_cross_entropy(
        self, logits: Array, labels: Array, scale: float
    ) -> tuple[Array, Array]:
        # the kernel indexes by label unchecked: one outside [0, K) reads and writes outside
        # the arrays (a wrong gradient, or a segfault); checked here (HostLabelChecks)
        self.check_labels(logits, labels)
        loss, grad = _softmax_xent(logits, labels, logits.dtype.type(scale))
        return np.asarray(loss), grad

    def sgd_update(self, p: Array, g: Any, lr: float) -> None:
        _sgd(p, _as_tuple(g), p.dtype.type(lr))

    def momentum_update(self, p: Array, g: Any, v: Array, lr: float, mu: float) -> None:
        t = p.dtype.type
        _momentum(p, _as_tuple(g), v, t(lr), t(mu), np.finfo(p.dtype).smallest_normal)

    def adam_update(self, p, g, m, v, lr, beta1, beta2, eps, step) -> None:  # noqa: ANN001
        t = p.dtype.type
        c1, c2 = 1 - beta1**step, 1 - beta2**step
        scalars = (t(lr / c1), t(beta1), t(beta2), t(1 - beta1), t(1 - beta2), t(eps), t(c2))
        tiny = np.finfo(p.dtype).smallest_normal
        _adam(p, _as_tuple(g), m, v, *scalars, tiny, np.sqrt(tiny))
