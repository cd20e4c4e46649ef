"""Numba-compiled CPU kernels: one pass over memory where NumPy would make several; products
stay with BLAS. Why the OpenMP wait policy is passive and each kernel has a serial twin:
docs/decisions/numba-wait-policy.md."""

import functools
import math
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numba as nb
import numpy as np
from numba import prange

from xpnn.backends import numba_conv as conv
from xpnn.backends import numba_seq as seq
from xpnn.backends.common import conv_out_hw, dropout_base_key, dropout_threshold, mask_rows
from xpnn.backends.kernels import GELU_A, GELU_C
from xpnn.backends.numba_jit import ACT_CODE, JIT, Twin, apply_act, apply_act_grad
from xpnn.backends.numpy_kernels import NumpyKernels


@Twin
def _bias_act(z, b, code):  # pragma: no cover - compiled
    n, m = z.shape
    for i in prange(n):
        for j in range(m):
            z[i, j] = apply_act(z[i, j] + b[j], code)
    return z


@Twin
def _bias_act_backward(dy, y, code, chunks):  # pragma: no cover - compiled
    """dz overwrites dy; per-chunk partial column sums keep the bias gradient parallel."""
    n, m = dy.shape
    partial = np.zeros((chunks, m), dtype=dy.dtype)
    step = (n + chunks - 1) // chunks
    for c in prange(chunks):
        for i in range(c * step, min(n, (c + 1) * step)):
            for j in range(m):
                g = apply_act_grad(dy[i, j], y[i, j], code)
                dy[i, j] = g
                partial[c, j] += g
    return dy, seq.summed(partial)


@Twin
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


# ``rows`` is a tuple, not a 2-D array, whose rows would be gathered element by element and
# lose the vectorisation (8x); a homogeneous tuple compiles once per length.
@Twin
def _sum_rows(out, rows):  # pragma: no cover - compiled
    for i in prange(out.size):
        total = rows[0][i]
        for r in range(1, len(rows)):
            total += rows[r][i]
        out[i] = total
    return out


@Twin
def _sgd(p, g, lr):  # pragma: no cover - compiled
    for i in prange(p.size):
        p[i] -= lr * g[i]


@Twin
def _momentum(p, g, v, lr, mu, tiny):  # pragma: no cover - compiled
    for i in prange(p.size):
        vi = mu * v[i] + g[i]
        if -tiny < vi < tiny:  # subnormal: zero (Kernels.flush_subnormal says why)
            vi = tiny - tiny
        v[i] = vi
        p[i] -= lr * vi


@Twin
def _adam(  # pragma: no cover - compiled
    p, g, m, v, lr_c1, beta1, beta2, one_m_b1, one_m_b2, eps, c2, decay, tiny
):
    """Scalars in the arrays' dtype: a float64 one promotes the float32 loop (4x slower)."""
    for i in prange(p.size):
        gi = g[i]
        mi = beta1 * m[i] + one_m_b1 * gi
        vi = beta2 * v[i] + one_m_b2 * (gi * gi)
        if -tiny < mi < tiny:  # subnormal: zero (Kernels.flush_subnormal says why)
            mi = tiny - tiny
        if -tiny < vi < tiny:
            vi = tiny - tiny
        m[i] = mi
        v[i] = vi
        p[i] = decay * p[i] - lr_c1 * (mi / (math.sqrt(vi / c2) + eps))


# the causal softmax serial only: a row is a few hundred flops, and the parallel build ran 4x
# slower than the serial one (5.7 vs 1.3 ms at 128x64x64 float32) on a loaded 2-core machine
_causal_shift_pack = nb.njit(**JIT)(seq.causal_shift_pack)
_causal_normalise_unpack = nb.njit(**JIT)(seq.causal_normalise_unpack)
_causal_softmax_backward = nb.njit(**JIT)(seq.causal_softmax_backward)
_bias_gelu_backward_f32 = Twin(seq.bias_gelu_backward_f32)
_bias_gelu_f32 = nb.njit(**JIT)(seq.bias_gelu_f32)
_column_sums = Twin(seq.column_sums)
_embedding_grad = nb.njit(**JIT)(seq.embedding_grad)
_gelu_backward = Twin(seq.gelu_backward)
_gelu_inner = nb.njit(**JIT)(seq.gelu_inner)
_gelu_outer = nb.njit(**JIT)(seq.gelu_outer)
_layer_norm = Twin(seq.layer_norm)
_layer_norm_input_grad = Twin(seq.layer_norm_input_grad)
_layer_norm_backward = nb.njit(**JIT)(seq.layer_norm_backward)
_layer_norm_param_grads = nb.njit(**JIT)(seq.layer_norm_param_grads)


def _row_constants(rows: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """The layer-norm kernels' (D,) ones and (1/D, eps), in the rows' dtype."""
    d = rows.shape[1]
    return np.ones(d, dtype=rows.dtype), np.array([1 / d, eps], dtype=rows.dtype)


@functools.cache
def _packed_values(t: int) -> int:
    """Values ``causal_shift_pack`` writes for one (T, T) matrix: ``min(T, g + 8)`` a row."""
    return sum(min(t, g + 8) * min(8, t - g) for g in range(0, t, 8))


def _causal_softmax_into(s: np.ndarray, p: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """``Kernels.causal_softmax`` of ``s * scale`` (N, T, T) into ``p`` (may be ``s``)."""
    n, t, _ = s.shape
    kind = p.dtype.type
    pk = np.empty(n * _packed_values(t), dtype=p.dtype)
    _causal_shift_pack(s, pk, kind(scale), kind(-np.inf))
    np.exp(pk, out=pk)
    return _causal_normalise_unpack(pk, np.ones(t, dtype=p.dtype), p)


# Taps a position (C_in*kh*kw) up to which the direct convolution beats im2col and one GEMM
# (forward + weight gradient, batch 128, one thread, ms): 9 taps (1x3x3) 1.0 + 2.3 against
# 2.6 + 2.8; 12 (3x2x2) 4.0 + 4.4 against 4.7 + 4.6; 16 (1x4x4) 3.2 + 3.5 against 2.8 + 2.9.
DIRECT_TAPS = 12


# Output widths below which im2col and col2im without padding go through an offset table
# (1 thread, batch 128, ms): the CNN's third convolution (2 wide) 0.24-0.30 + 0.34-0.44 against
# 0.82-1.27 + 0.77-0.96 row by row; its second (10 wide) 2.0-2.2 + 3.2 against 1.5-1.6 + 1.7.
GATHER_BELOW = 8


def _gather_table(x_shape: tuple[int, ...], stride: int, oh: int, ow: int) -> np.ndarray:
    """``conv.im2col_gather``'s offsets: output (n, r, q)'s window corner in ``x.flat``."""
    n, c, h, w = x_shape
    r, q = np.meshgrid(np.arange(oh) * stride * w, np.arange(ow) * stride, indexing="ij")
    return (np.arange(n)[:, None] * (c * h * w) + (r + q).reshape(1, -1)).reshape(-1)


def _tasks(n: int, c: int) -> int:
    """Batch chunks per channel of the im2col/col2im loops: a few tasks per thread."""
    want = 4 * nb.get_num_threads()
    return max(1, min(n, math.ceil(want / max(c, 1))))


class NumbaKernels(NumpyKernels):
    """NumPy's kernels with the memory-bound ones replaced by fused, threaded Numba loops."""

    def conv_relu_pool_pays(self) -> bool:
        return True

    def conv_relu_pool(self, yc, b, shape):
        n, c, oh, ow = shape
        y = np.empty((n, c, oh // 2, ow // 2), dtype=yc.dtype)
        idx = np.empty(y.shape, dtype=np.uint8)
        return conv.conv_relu_pool2x2(np.ascontiguousarray(yc), b, y, idx, yc.dtype.type(0))

    def conv_relu_pool_grad(self, dy, y, idx, shape, out=None):
        n, c = dy.shape[:2]
        if out is None:
            out = np.empty((c, n * math.prod(shape[2:])), dtype=dy.dtype)
        dy, db, zero = np.ascontiguousarray(dy), np.empty(c, dtype=dy.dtype), dy.dtype.type(0)
        return conv.conv_relu_pool2x2_grad(dy, y, idx, out, db, zero, _tasks(c, 1))

    def conv_direct_relu_pool(self, x, w, b, stride, padding, out_hw):
        x, (c_out, _, kh, kw) = np.ascontiguousarray(x), w.shape
        y = np.empty((x.shape[0], c_out, out_hw[0] // 2, out_hw[1] // 2), dtype=x.dtype)
        idx, w2 = np.empty(y.shape, dtype=np.uint8), np.ascontiguousarray(w).reshape(c_out, -1)
        chunks, zero = _tasks(x.shape[0], 1), x.dtype.type(0)
        return conv.conv_direct_relu_pool(x, w2, b, kh, kw, stride, padding, y, idx, chunks, zero)

    def conv_direct_relu_pool_backward(self, dy, x, y, idx, w, stride, padding, dw, need_dx):
        dy, (c_out, _, kh, kw) = np.ascontiguousarray(dy), w.shape
        chunks = _tasks(x.shape[0], 1)
        pdw = np.zeros((chunks, c_out, dw.size // c_out), dtype=dy.dtype)
        pdb = np.zeros((chunks, c_out), dtype=dy.dtype)
        dx = np.empty(x.shape if need_dx else (0, *x.shape[1:]), dtype=dy.dtype)
        w2, geometry = np.ascontiguousarray(w).reshape(c_out, -1), (kh, kw, stride, padding)
        zero = dy.dtype.type(0)
        conv.conv_direct_relu_pool_backward(dy, x, y, idx, w2, *geometry, dx, pdw, pdb, zero)
        np.sum(pdw, axis=0, out=dw.reshape(c_out, -1))
        return pdb.sum(axis=0), (dx if need_dx else None)

    def bias_act(self, z, b, act):
        return _bias_act(z, b, ACT_CODE[act])

    def bias_act_backward(self, dy, y, act):
        chunks = max(1, min(nb.get_num_threads(), dy.shape[0]))
        if act != "identity":
            return _bias_act_backward(dy, y, ACT_CODE[act], chunks)
        return dy, _column_sums(dy, chunks)

    def softmax_cross_entropy(self, logits, labels, scale):
        self.check_labels(logits, labels)
        loss, grad = _softmax_xent(logits, labels, logits.dtype.type(scale))
        return np.asarray(loss), grad

    def sum_rows(self, rows, out):
        return _sum_rows(out, tuple(rows))

    def sgd_update(self, p, g, lr):
        _sgd(p, g, p.dtype.type(lr))

    def momentum_update(self, p, g, v, lr, mu):
        t = p.dtype.type
        _momentum(p, g, v, t(lr), t(mu), np.finfo(p.dtype).smallest_normal)

    def adam_update(self, p, g, m, v, lr, beta1, beta2, eps, step, decay=1.0):
        t = p.dtype.type
        c1, c2 = 1 - beta1**step, 1 - beta2**step
        scalars = (t(lr / c1), t(beta1), t(beta2), t(1 - beta1), t(1 - beta2), t(eps), t(c2))
        _adam(p, g, m, v, *scalars, t(decay), np.finfo(p.dtype).smallest_normal)

    def im2col(self, x, kh, kw, stride, padding, out=None, out_hw=None):
        x = np.ascontiguousarray(x)
        n, c = x.shape[:2]
        oh, ow = conv_out_hw(x.shape, kh, kw, stride, padding, out_hw)
        if out is None:
            out = np.empty((c * kh * kw, n * oh * ow), dtype=x.dtype)
        if padding == 0 and ow < GATHER_BELOW:
            tab = _gather_table(x.shape, stride, oh, ow)
            return conv.im2col_gather(x, kh, kw, out, tab, _tasks(n, c))
        if padding == 0 and stride == 1:
            return conv.im2col_valid(x, kh, kw, oh, ow, out, _tasks(n, c))
        return conv.im2col(x, kh, kw, stride, padding, oh, ow, out, _tasks(n, c))

    def col2im(self, cols, x_shape, kh, kw, stride, padding, out_hw=None):
        n, c = x_shape[:2]
        oh, ow = conv_out_hw(x_shape, kh, kw, stride, padding, out_hw)
        dx = np.empty(tuple(x_shape), dtype=cols.dtype)
        cols = np.ascontiguousarray(cols)
        if padding == 0 and ow < GATHER_BELOW:
            tab = _gather_table(x_shape, stride, oh, ow)
            return conv.col2im_scatter(cols, dx, kh, kw, tab, _tasks(n, c))
        if padding == 0 and stride == 1:
            return conv.col2im_valid(cols, dx, kh, kw, oh, ow, _tasks(n, c))
        return conv.col2im(cols, dx, kh, kw, stride, padding, oh, ow, _tasks(n, c))

    def conv_output(self, yc, b, shape, act="identity"):
        n, c, oh, ow = shape
        y = np.empty((n, c, oh * ow), dtype=yc.dtype)
        conv.conv_output(np.ascontiguousarray(yc), b, y, ACT_CODE[act])
        return y.reshape(shape)

    def conv_output_grad(self, dy, out=None, y=None, act="identity"):
        n, c, oh, ow = dy.shape
        if out is None:
            out = np.empty((c, n * oh * ow), dtype=dy.dtype)
        dy3 = np.ascontiguousarray(dy).reshape(n, c, oh * ow)
        y3 = dy3 if act == "identity" else np.ascontiguousarray(y).reshape(n, c, oh * ow)
        return conv.conv_output_grad(dy3, y3, out, np.empty(c, dtype=dy.dtype), ACT_CODE[act])

    def conv_direct_pays(self, c_in, kh, kw, stride):
        return c_in * kh * kw <= DIRECT_TAPS

    def conv_direct(self, x, w, b, stride, padding, out_hw, act):
        x = np.ascontiguousarray(x)
        c_out, _, kh, kw = w.shape
        y = np.empty((x.shape[0], c_out, *out_hw), dtype=x.dtype)
        w2 = np.ascontiguousarray(w).reshape(c_out, -1)
        chunks = _tasks(x.shape[0], 1)
        return conv.conv_direct(x, w2, b, kh, kw, stride, padding, y, chunks, ACT_CODE[act])

    def conv_direct_backward(self, dy, x, y, w, stride, padding, act, dw, need_dx):
        dy = np.ascontiguousarray(dy)
        y = dy if act == "identity" else np.ascontiguousarray(y)  # unread for the identity
        c_out, _, kh, kw = w.shape
        chunks = _tasks(x.shape[0], 1)
        pdw = np.zeros((chunks, c_out, dw.size // c_out), dtype=dy.dtype)
        pdb = np.zeros((chunks, c_out), dtype=dy.dtype)
        dx = np.empty(x.shape if need_dx else (0, *x.shape[1:]), dtype=dy.dtype)
        w2 = np.ascontiguousarray(w).reshape(c_out, -1)
        geometry = (kh, kw, stride, padding)
        conv.conv_direct_backward(dy, x, y, w2, *geometry, ACT_CODE[act], dx, pdw, pdb)
        np.sum(pdw, axis=0, out=dw.reshape(c_out, -1))
        return pdb.sum(axis=0), (dx if need_dx else None)

    def maxpool2d_forward(self, x, size, stride):
        x = np.ascontiguousarray(x)
        shape = (*x.shape[:2], *conv_out_hw(x.shape, size, size, stride, 0))
        y = np.empty(shape, dtype=x.dtype)
        idx = np.empty(shape, dtype=np.uint8 if size <= 16 else np.int32)
        if size == 2 and stride == 2:
            return conv.maxpool2x2(x, y, idx)
        return conv.maxpool_forward(x, size, stride, y, idx)

    def maxpool2d_backward(self, dy, idx, x_shape, size, stride):
        dx = np.empty(tuple(x_shape), dtype=dy.dtype)
        dy = np.ascontiguousarray(dy)
        if size == 2 and stride == 2:
            tasks = _tasks(dy.shape[0] * dy.shape[1], 1)
            return conv.maxpool2x2_backward(dy, np.ascontiguousarray(idx), dx, tasks)
        return conv.maxpool_backward(dy, idx, size, stride, dx)

    def dropout_mask(self, shape, p, seed, step, sample_ids, dtype, salt=0):
        ids = np.ascontiguousarray(sample_ids, dtype=np.int64)
        dtype = np.dtype(dtype)
        out = np.empty(mask_rows(shape, ids), dtype=dtype)
        base = np.uint64(dropout_base_key(seed, step, salt))
        threshold = np.uint64(dropout_threshold(p))
        conv.dropout_mask(ids, base, threshold, dtype.type(1.0 / (1.0 - p)), out)
        return out.reshape(shape)

    def embedding_grad(self, ids, dy, out):
        if ids.size and (ids.min() < 0 or ids.max() >= out.shape[0]):  # the loop checks none
            raise IndexError(f"embedding ids outside [0, {out.shape[0]})")
        return _embedding_grad(np.ascontiguousarray(ids), np.ascontiguousarray(dy), out)

    def gelu_backward(self, dy, x, t):
        flat = np.ascontiguousarray(x).reshape(-1)
        dx = np.empty_like(flat)
        consts = seq.gelu_grad_constants(flat.dtype)
        _gelu_backward(np.ascontiguousarray(dy).reshape(-1), flat, t.reshape(-1), dx, *consts)
        return dx.reshape(x.shape)

    def layer_norm(self, x, gamma, beta, eps):
        rows = np.ascontiguousarray(x).reshape(-1, x.shape[-1])
        y, xhat = np.empty_like(rows), np.empty_like(rows)
        inv_std = np.empty(rows.shape[0], dtype=rows.dtype)
        _layer_norm(rows, gamma, beta, *_row_constants(rows, eps), y, xhat, inv_std)
        return y.reshape(x.shape), xhat.reshape(x.shape), inv_std.reshape(*x.shape[:-1], 1)

    def layer_norm_backward(self, dy, xhat, inv_std, gamma, need_dx):
        rows = np.ascontiguousarray(dy).reshape(-1, dy.shape[-1])
        xhat_rows = xhat.reshape(rows.shape)
        dgamma, dbeta = np.empty_like(gamma), np.empty_like(gamma)
        dx = np.empty_like(rows) if need_dx else None
        args = (rows, xhat_rows, inv_std.reshape(-1), gamma, *_row_constants(rows, 0.0), dx)
        serial = rows.size < _layer_norm_input_grad.min_elements or nb.get_num_threads() == 1
        if need_dx and serial:  # one pass where the Twin would take its serial build
            _layer_norm_backward(*args, dgamma, dbeta)
            return dx.reshape(dy.shape), dgamma, dbeta
        _layer_norm_param_grads(rows, xhat_rows, dgamma, dbeta)
        if need_dx:
            _layer_norm_input_grad(*args)
        return (dx.reshape(dy.shape) if need_dx else None), dgamma, dbeta

    def gelu(self, x):
        # two compiled passes around NumPy's SIMD tanh (30x a compiled math.tanh) where NumPy
        # alone makes seven: 1.1 against 1.7 ms over 2048x512 float32
        flat = np.ascontiguousarray(x).reshape(-1)
        y, t = np.empty_like(flat), np.empty_like(flat)
        kind = flat.dtype.type
        _gelu_inner(flat, t, kind(GELU_C), kind(GELU_A))
        np.tanh(t, out=t)
        _gelu_outer(flat, t, y, kind(0.5), kind(1.0))
        return y.reshape(x.shape), t.reshape(x.shape)

    def bias_gelu(self, z, b):
        if z.dtype != np.float32:  # NumPy's tanh between passes: the generic formula's bits
            return super().bias_gelu(z, b)
        y, kind = np.empty_like(z), z.dtype.type  # a rational tanh, to a few ulp: one pass
        _bias_gelu_f32(z, b, y, seq.TANH_F32, kind(GELU_C), kind(GELU_A))
        return z, y, None  # no tanh kept: the backward computes it again

    def bias_gelu_backward(self, dy, x, t):
        if t is not None:
            return super().bias_gelu_backward(dy, x, t)
        chunks = max(1, min(nb.get_num_threads(), dy.shape[0]))
        c, c3a = seq.gelu_grad_constants(x.dtype)[:2]
        a = x.dtype.type(GELU_A)
        return dy, _bias_gelu_backward_f32(dy, x, seq.TANH_F32, c, a, c3a, chunks)

    def causal_attention(self, q, k, v, scale, out=None):
        # whole (T, T) products: OpenBLAS's float32 kernels round a block of rows otherwise
        # than the whole (a causal block skip gave other bits, and no time at T = 64)
        t = q.shape[-2]
        p = np.matmul(q, k.swapaxes(-1, -2))  # a view: BLAS reads it as is
        rows = p.reshape(-1, t, t)
        _causal_softmax_into(rows, rows, scale)  # the scale applied in the same pass
        return np.matmul(p, v, out=out), p

    def causal_attention_backward(self, dout, q, k, v, p, scale, out=None):
        t = p.shape[-1]
        dq, dk, dv = out or (np.empty_like(q), np.empty_like(k), np.empty_like(v))
        np.matmul(p.swapaxes(-1, -2), dout, out=dv)
        ds = np.matmul(dout, v.swapaxes(-1, -2))
        rows = ds.reshape(-1, t, t)
        # row by row, in place, the scale applied in the same pass
        _causal_softmax_backward(rows, p.reshape(-1, t, t), rows, rows.dtype.type(scale))
        np.matmul(ds, k, out=dq)
        np.matmul(ds.swapaxes(-1, -2), q, out=dk)
        return dq, dk, dv

    def causal_softmax(self, scores):
        t = scores.shape[-1]
        s = np.ascontiguousarray(scores).reshape(-1, t, t)
        return _causal_softmax_into(s, np.empty_like(s)).reshape(scores.shape)

    def causal_softmax_backward(self, dp, p):
        t = p.shape[-1]
        dp3 = np.ascontiguousarray(dp).reshape(-1, t, t)
        p3 = np.ascontiguousarray(p).reshape(-1, t, t)
        one = p3.dtype.type(1)
        return _causal_softmax_backward(dp3, p3, np.empty_like(p3), one).reshape(p.shape)
