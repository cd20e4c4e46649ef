"""Numba convolution, pooling and dropout kernels: threaded loops, one pass over memory each.

Same layouts and results as ``conv_kernels`` (see its docstring). The im2col/col2im loops are
split into (channel, batch-chunk) tasks: each task owns whole rows of ``cols`` (contiguous
writes) and whole planes ``dx[n, c]`` (no races, no atomics), and there are enough tasks for
every thread even when C = 1. Pooling and dropout are parallel over batch x channel planes and
samples.
"""

from __future__ import annotations

import math
from typing import Any

import numba as nb
import numpy as np
from numba import prange

from xpnn.backends.conv_kernels import (
    GOLDEN,
    conv_out_size,
    dropout_base_key,
    dropout_threshold,
)
from xpnn.backends.kernels import NumpyKernels

Array = Any
_JIT = {"nogil": True, "cache": True}
_M32 = np.uint64(0xFFFFFFFF)
_M1 = np.uint64(0x85EBCA6B)
_M2 = np.uint64(0xC2B2AE35)
_GOLDEN = np.uint64(GOLDEN)
_S16 = np.uint64(16)
_S13 = np.uint64(13)
U = np.uint64


@nb.njit(**_JIT)
def _fmix32(h):  # pragma: no cover - compiled
    """murmur3 fmix32 on a uint64 holding a uint32 (Numba widens integers to 64 bits)."""
    h = h ^ (h >> _S16)
    h = (h * _M1) & _M32
    h = h ^ (h >> _S13)
    h = (h * _M2) & _M32
    return h ^ (h >> _S16)


@nb.njit(**_JIT)
def _mix(h, k):  # pragma: no cover - compiled
    return _fmix32(h ^ _fmix32((k + _GOLDEN) & _M32))


@nb.njit(**_JIT)
def _valid_range(j, pad, stride, size, count):  # pragma: no cover - compiled
    """Output positions q in [lo, hi) whose input ``q*stride + j - pad`` is inside [0, size)."""
    lo = 0
    if pad - j > 0:
        lo = (pad - j + stride - 1) // stride
    hi = (size - 1 - j + pad) // stride + 1 if size - 1 - j + pad >= 0 else 0
    lo = min(lo, count)
    hi = max(lo, min(hi, count))
    return lo, hi


# Indices below are cast to uint64 (``U``) before indexing: Numba then skips the negative-index
# wraparound test, which otherwise keeps LLVM from vectorising the inner loops (3-10x slower).


@nb.njit(parallel=True, **_JIT)
def _im2col(x, kh, kw, stride, pad, oh, ow, out, chunks):  # pragma: no cover - compiled
    n, c, h, w = x.shape
    p = oh * ow
    step = (n + chunks - 1) // chunks
    su = U(stride)
    for t in prange(c * chunks):
        ci = t // chunks
        n0 = (t % chunks) * step
        n1 = min(n, n0 + step)
        cu = U(ci)
        for i in range(kh):
            for j in range(kw):
                row = U((ci * kh + i) * kw + j)
                lo, hi = _valid_range(j, pad, stride, w, ow)
                first = U(lo * stride + j - pad)  # input column of output column lo
                lou, cnt, owu = U(lo), U(hi - lo), U(ow)
                for b in range(n0, n1):
                    bu = U(b)
                    for y in range(oh):
                        o = U(b * p + y * ow)
                        hh = y * stride + i - pad
                        if hh < 0 or hh >= h:
                            for q in range(owu):
                                out[row, o + q] = 0
                            continue
                        hu = U(hh)
                        for q in range(lou):
                            out[row, o + q] = 0
                        dst = o + lou
                        if stride == 1:
                            for q in range(cnt):
                                out[row, dst + q] = x[bu, cu, hu, first + q]
                        else:
                            for q in range(cnt):
                                out[row, dst + q] = x[bu, cu, hu, first + q * su]
                        for q in range(lou + cnt, owu):
                            out[row, o + q] = 0
    return out


@nb.njit(parallel=True, **_JIT)
def _col2im(cols, dx, kh, kw, stride, pad, oh, ow, chunks):  # pragma: no cover - compiled
    n, c, h, w = dx.shape
    p = oh * ow
    step = (n + chunks - 1) // chunks
    su = U(stride)
    for t in prange(c * chunks):
        ci = t // chunks
        n0 = (t % chunks) * step
        n1 = min(n, n0 + step)
        cu = U(ci)
        for b in range(n0, n1):
            dx[U(b), cu, :, :] = 0
        for i in range(kh):
            for j in range(kw):
                row = U((ci * kh + i) * kw + j)
                lo, hi = _valid_range(j, pad, stride, w, ow)
                first = U(lo * stride + j - pad)
                lou, cnt = U(lo), U(hi - lo)
                for b in range(n0, n1):
                    bu = U(b)
                    for y in range(oh):
                        hh = y * stride + i - pad
                        if hh < 0 or hh >= h:
                            continue
                        hu = U(hh)
                        src = U(b * p + y * ow) + lou
                        if stride == 1:
                            for q in range(cnt):
                                dx[bu, cu, hu, first + q] += cols[row, src + q]
                        else:
                            for q in range(cnt):
                                dx[bu, cu, hu, first + q * su] += cols[row, src + q]
    return dx


@nb.njit(parallel=True, **_JIT)
def _conv_output(yc, bias, y):  # pragma: no cover - compiled
    """y[n, c, :] = yc[c, n*P:(n+1)*P] + bias[c]; y is (N, C, P)."""
    n, c, p = y.shape
    pu = U(p)
    for b in prange(n):
        bu = U(b)
        o = bu * pu
        for ci in range(U(c)):
            bc = bias[ci]
            for k in range(pu):
                y[bu, ci, k] = yc[ci, o + k] + bc
    return y


@nb.njit(parallel=True, **_JIT)
def _conv_output_grad(dy, out):  # pragma: no cover - compiled
    """out[c, n*P + k] = dy[n, c, k]."""
    n, c, p = dy.shape
    pu, nu = U(p), U(n)
    for ci in prange(c):
        cu = U(ci)
        for b in range(nu):
            o = b * pu
            for k in range(pu):
                out[cu, o + k] = dy[b, cu, k]
    return out


@nb.njit(parallel=True, **_JIT)
def _maxpool_forward(x, size, stride, y, idx):  # pragma: no cover - compiled
    n, c, h, w = x.shape
    _, _, oh, ow = y.shape
    for t in prange(n * c):
        bu = U(t // c)
        cu = U(t % c)
        for r in range(U(oh)):
            for q in range(U(ow)):
                h0 = r * U(stride)
                w0 = q * U(stride)
                best = x[bu, cu, h0, w0]
                k = 0
                for i in range(U(size)):
                    for j in range(U(size)):
                        v = x[bu, cu, h0 + i, w0 + j]
                        if v > best:
                            best = v
                            k = i * size + j
                y[bu, cu, r, q] = best
                idx[bu, cu, r, q] = k
    return y, idx


@nb.njit(parallel=True, **_JIT)
def _maxpool_backward(dy, idx, size, stride, dx):  # pragma: no cover - compiled
    n, c, h, w = dx.shape
    _, _, oh, ow = dy.shape
    su, szu = U(stride), U(size)
    for t in prange(n * c):
        bu = U(t // c)
        cu = U(t % c)
        dx[bu, cu, :, :] = 0
        for r in range(U(oh)):
            for q in range(U(ow)):
                k = U(idx[bu, cu, r, q])
                dx[bu, cu, r * su + k // szu, q * su + k % szu] += dy[bu, cu, r, q]
    return dx


@nb.njit(parallel=True, **_JIT)
def _dropout_mask(ids, base, threshold, scale, out):  # pragma: no cover - compiled
    n, f = out.shape
    elems = np.empty(f, dtype=np.uint64)
    for e in range(f):
        elems[e] = _fmix32((np.uint64(e) + _GOLDEN) & _M32)
    for b in prange(n):
        sid = ids[b]
        lo = np.uint64(sid & 0xFFFFFFFF)
        hi = np.uint64((sid >> 32) & 0xFFFFFFFF)
        s = _mix(_mix(base, lo), hi)
        for e in range(f):
            out[b, e] = scale if _fmix32(s ^ elems[e]) >= threshold else 0
    return out


def _chunks(n: int, c: int) -> int:
    """Batch chunks per channel so that there are a few tasks per thread."""
    want = 4 * nb.get_num_threads()
    return max(1, min(n, math.ceil(want / max(c, 1))))


class NumbaConvKernels(NumpyKernels):
    """Numba overrides of every convolution, pooling and dropout kernel."""

    def im2col(
        self, x: Array, kh: int, kw: int, stride: int, padding: int, out: Array | None = None
    ) -> Array:
        x = np.ascontiguousarray(x)
        n, c, h, w = x.shape
        oh, ow = conv_out_size(h, kh, stride, padding), conv_out_size(w, kw, stride, padding)
        if out is None:
            out = np.empty((c * kh * kw, n * oh * ow), dtype=x.dtype)
        return _im2col(x, kh, kw, stride, padding, oh, ow, out, _chunks(n, c))

    def col2im(
        self, cols: Array, x_shape: tuple[int, ...], kh: int, kw: int, stride: int, padding: int
    ) -> Array:
        n, c, h, w = x_shape
        oh, ow = conv_out_size(h, kh, stride, padding), conv_out_size(w, kw, stride, padding)
        dx = np.empty(tuple(x_shape), dtype=cols.dtype)
        cols = np.ascontiguousarray(cols)
        return _col2im(cols, dx, kh, kw, stride, padding, oh, ow, _chunks(n, c))

    def conv_output(self, yc: Array, b: Array, shape: tuple[int, ...]) -> Array:
        n, c, oh, ow = shape
        y = np.empty((n, c, oh * ow), dtype=yc.dtype)
        _conv_output(np.ascontiguousarray(yc), b, y)
        return y.reshape(shape)

    def conv_output_grad(self, dy: Array, out: Array | None = None) -> tuple[Array, Array]:
        n, c, oh, ow = dy.shape
        if out is None:
            out = np.empty((c, n * oh * ow), dtype=dy.dtype)
        _conv_output_grad(np.ascontiguousarray(dy).reshape(n, c, oh * ow), out)
        return out, out.sum(axis=1)

    def maxpool2d_forward(self, x: Array, size: int, stride: int) -> tuple[Array, Array]:
        x = np.ascontiguousarray(x)
        n, c, h, w = x.shape
        oh, ow = (h - size) // stride + 1, (w - size) // stride + 1
        y = np.empty((n, c, oh, ow), dtype=x.dtype)
        idx = np.empty((n, c, oh, ow), dtype=np.int32)
        return _maxpool_forward(x, size, stride, y, idx)

    def maxpool2d_backward(
        self, dy: Array, idx: Array, x_shape: tuple[int, ...], size: int, stride: int
    ) -> Array:
        dx = np.empty(tuple(x_shape), dtype=dy.dtype)
        return _maxpool_backward(np.ascontiguousarray(dy), idx, size, stride, dx)

    def dropout_mask(
        self,
        shape: tuple[int, ...],
        p: float,
        seed: int,
        step: int,
        sample_ids: Array,
        dtype: Any,
        salt: int = 0,
    ) -> Array:
        n = shape[0]
        ids = np.ascontiguousarray(sample_ids, dtype=np.int64)
        if ids.shape[0] != n:
            raise ValueError(f"{ids.shape[0]} sample ids for a batch of {n}")
        dtype = np.dtype(dtype)
        out = np.empty((n, math.prod(shape[1:])), dtype=dtype)
        base = np.uint64(dropout_base_key(seed, step, salt))
        threshold = np.uint64(dropout_threshold(p))
        _dropout_mask(ids, base, threshold, dtype.type(1.0 / (1.0 - p)), out)
        return out.reshape(shape)
