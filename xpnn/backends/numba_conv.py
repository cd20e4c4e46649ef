"""Numba convolution, pooling and dropout kernels: threaded loops, one pass over memory each.
im2col/col2im run as (channel, batch-chunk) tasks, each owning whole rows of ``cols`` and whole
planes ``dx[n, c]`` (no races), enough for every thread even when C = 1."""

import numba as nb
import numpy as np
from numba import prange

from xpnn.backends.common import FMIX_M1, FMIX_M2, GOLDEN, MASK32
from xpnn.backends.numba_jit import JIT, apply_act, apply_act_grad, parallel_twin

_M32 = np.uint64(MASK32)
_M1 = np.uint64(FMIX_M1)
_M2 = np.uint64(FMIX_M2)
_GOLDEN = np.uint64(GOLDEN)
_S16 = np.uint64(16)
_S13 = np.uint64(13)
U = np.uint64


@nb.njit(**JIT)
def _fmix32(h):  # pragma: no cover - compiled
    """murmur3 fmix32 on a uint64 holding a uint32 (Numba widens integers to 64 bits)."""
    h = h ^ (h >> _S16)
    h = (h * _M1) & _M32
    h = h ^ (h >> _S13)
    h = (h * _M2) & _M32
    return h ^ (h >> _S16)


@nb.njit(**JIT)
def _mix(h, k):  # pragma: no cover - compiled
    return _fmix32(h ^ _fmix32((k + _GOLDEN) & _M32))


@nb.njit(**JIT)
def _valid_range(j, pad, stride, size, count):  # pragma: no cover - compiled
    """Output positions q in [lo, hi) whose input ``q*stride + j - pad`` is inside [0, size)."""
    lo = 0
    if pad - j > 0:
        lo = (pad - j + stride - 1) // stride
    hi = (size - 1 - j + pad) // stride + 1 if size - 1 - j + pad >= 0 else 0
    lo = min(lo, count)
    hi = max(lo, min(hi, count))
    return lo, hi


# inlined in Numba's IR: as a call it cost im2col of small padded planes 5 % (64 x 8 x 12 x 12,
# 3x3, padding 1: 0.166-0.172 ms against 0.155-0.161 written out, 1 thread)
@nb.njit(inline="always", **JIT)
def _tap(ci, i, j, kh, kw, stride, pad, w, ow):  # pragma: no cover - compiled
    """Tap (``ci``, ``i``, ``j``) of a window: its row of the columns, the input column of its
    first output column in range, that output column and the count in range, as ``U``."""
    lo, hi = _valid_range(j, pad, stride, w, ow)
    row = U((ci * kh + i) * kw + j)
    return row, U(lo * stride + j - pad), U(lo), U(hi - lo)


# Indices below are cast to uint64 (``U``) before indexing: Numba then skips the negative-index
# wraparound test, which otherwise keeps LLVM from vectorising the inner loops (3-10x slower).


@parallel_twin
def im2col(x, kh, kw, stride, pad, oh, ow, out, chunks):  # pragma: no cover - compiled
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
                row, first, lou, cnt = _tap(ci, i, j, kh, kw, stride, pad, w, ow)
                owu = U(ow)
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


# A task's loops in a function of their own, called from ``prange``: written inline, the
# parallel builds of these ran 1.7-2.9x slower than their serial twins on one thread (their
# inner loops not vectorised), so two threads barely beat one.
@nb.njit(**JIT)
def _im2col_valid_task(x, kh, kw, oh, ow, out, ci, n0, n1):  # pragma: no cover - compiled
    p, owu = oh * ow, U(ow)
    for i in range(kh):
        for j in range(kw):
            row = out[U((ci * kh + i) * kw + j)]
            for b in range(n0, n1):
                plane = x[U(b), U(ci)]
                for y in range(U(oh)):
                    xr, o = plane[y + U(i)], U(b * p) + y * owu
                    for q in range(owu):
                        row[o + q] = xr[U(j) + q]


@parallel_twin
def im2col_valid(x, kh, kw, oh, ow, out, chunks):  # pragma: no cover - compiled
    """``im2col`` at stride 1 without padding: every window row in range, copied whole
    (1.17 against 1.43 ms for the CNN's second convolution, 1 thread)."""
    n, c = x.shape[:2]
    step = (n + chunks - 1) // chunks
    for t in prange(c * chunks):
        n0 = (t % chunks) * step
        _im2col_valid_task(x, kh, kw, oh, ow, out, t // chunks, n0, min(n, n0 + step))
    return out


@nb.njit(**JIT)
def _col2im_valid_task(cols, dx, kh, kw, oh, ow, ci, n0, n1):  # pragma: no cover - compiled
    _, _, h, w = dx.shape
    p, owu = oh * ow, U(ow)
    for b in range(n0, n1):
        plane = dx[U(b), U(ci)]
        for r in range(U(h)):
            for q in range(U(w)):
                plane[r, q] = 0
        for i in range(kh):
            for j in range(kw):
                row = cols[U((ci * kh + i) * kw + j)]
                for y in range(U(oh)):
                    pr, o = plane[y + U(i)], U(b * p) + y * owu
                    for q in range(owu):
                        pr[U(j) + q] += row[o + q]


@parallel_twin
def col2im_valid(cols, dx, kh, kw, oh, ow, chunks):  # pragma: no cover - compiled
    """``im2col_valid``'s adjoint, sample by sample: each plane stays in cache while its kh*kw
    rows are added, in ``col2im``'s order (the same sums; 1.0 against 1.55 ms, as above)."""
    n, c = dx.shape[:2]
    step = (n + chunks - 1) // chunks
    for t in prange(c * chunks):
        n0 = (t % chunks) * step
        _col2im_valid_task(cols, dx, kh, kw, oh, ow, t // chunks, n0, min(n, n0 + step))
    return dx


@parallel_twin
def im2col_gather(x, kh, kw, out, tab, chunks):  # pragma: no cover - compiled
    """``im2col`` without padding for narrow outputs, where row-by-row loops would be mostly
    overhead: out[row, k] = x.flat[base(row) + tab[k]] (``_gather_table``'s offsets)."""
    n, c, h, w = x.shape
    xf = x.reshape(-1)
    p = tab.shape[0] // n
    step = (n + chunks - 1) // chunks
    for t in prange(c * chunks):
        ci = t // chunks
        k0 = U((t % chunks) * step * p)
        k1 = U(min(n, (t % chunks) * step + step) * p)
        for i in range(kh):
            for j in range(kw):
                row = out[U((ci * kh + i) * kw + j)]
                base = U(ci * h * w + i * w + j)
                for k in range(k0, k1):
                    row[k] = xf[base + U(tab[k])]
    return out


@parallel_twin
def col2im_scatter(cols, dx, kh, kw, tab, chunks):  # pragma: no cover - compiled
    """``im2col_gather``'s adjoint: each row of ``cols`` added back through the same offsets
    (a task owns one channel's planes over a batch chunk: no races)."""
    n, c, h, w = dx.shape
    dxf = dx.reshape(-1)
    p = tab.shape[0] // n
    step = (n + chunks - 1) // chunks
    hw = U(h * w)
    for t in prange(c * chunks):
        ci = t // chunks
        b0 = (t % chunks) * step
        b1 = min(n, b0 + step)
        for b in range(b0, b1):
            o = (U(b) * U(c) + U(ci)) * hw
            for e in range(hw):
                dxf[o + e] = 0
        for i in range(kh):
            for j in range(kw):
                row = cols[U((ci * kh + i) * kw + j)]
                base = U(ci * h * w + i * w + j)
                for k in range(U(b0 * p), U(b1 * p)):
                    dxf[base + U(tab[k])] += row[k]
    return dx


@parallel_twin
def col2im(cols, dx, kh, kw, stride, pad, oh, ow, chunks):  # pragma: no cover - compiled
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
            for row in range(U(h)):
                for col in range(U(w)):
                    dx[U(b), cu, row, col] = 0
        for i in range(kh):
            for j in range(kw):
                row, first, lou, cnt = _tap(ci, i, j, kh, kw, stride, pad, w, ow)
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


@parallel_twin
def conv_output(yc, bias, y, code):  # pragma: no cover - compiled
    """y[n, c, :] = act(yc[c, n*P:(n+1)*P] + bias[c]); y is (N, C, P)."""
    n, c, p = y.shape
    pu = U(p)
    for b in prange(n):
        bu = U(b)
        o = bu * pu
        for ci in range(U(c)):
            bc = bias[ci]
            if code == 1:  # the common case, kept branch-free for the vectoriser
                for k in range(pu):
                    v = yc[ci, o + k] + bc
                    y[bu, ci, k] = 0 if v <= 0 else v  # NaN stays NaN
            else:
                for k in range(pu):
                    y[bu, ci, k] = apply_act(yc[ci, o + k] + bc, code)
    return y


@parallel_twin
def conv_output_grad(dy, y, out, db, code):  # pragma: no cover - compiled
    """out[c, n*P + k] = act'(dy[n, c, k]) (``y`` unused for the identity), and db[c] the sum
    of out's row c, summed while the row is in cache."""
    n, c, p = dy.shape
    pu, nu = U(p), U(n)
    for ci in prange(c):
        cu = U(ci)
        for b in range(nu):
            o = b * pu
            if code == 0:
                for k in range(pu):
                    out[cu, o + k] = dy[b, cu, k]
            elif code == 1:
                for k in range(pu):
                    out[cu, o + k] = dy[b, cu, k] if y[b, cu, k] > 0 else 0
            else:
                for k in range(pu):
                    out[cu, o + k] = apply_act_grad(dy[b, cu, k], y[b, cu, k], code)
        db[cu] = _sum(out[cu]) if nu * pu > 0 else 0  # _sum reads a first value
    return out, db


@parallel_twin
def maxpool2x2(x, y, idx):  # pragma: no cover - compiled
    """The common 2x2, stride-2 case, unrolled."""
    n, c, h, w = x.shape
    _, _, oh, ow = y.shape
    for t in prange(n * c):
        bu = U(t // c)
        cu = U(t % c)
        for r in range(U(oh)):
            h0 = r * U(2)
            for q in range(U(ow)):
                w0 = q * U(2)
                a0 = x[bu, cu, h0, w0]
                a1 = x[bu, cu, h0, w0 + U(1)]
                a2 = x[bu, cu, h0 + U(1), w0]
                a3 = x[bu, cu, h0 + U(1), w0 + U(1)]
                # "not <=" is true for a NaN too, and once best is NaN it stays: the first
                # NaN in a window wins, as np.maximum and np.argmax have it
                best, k = a0, 0
                if not (a1 <= best) and best == best:
                    best, k = a1, 1
                if not (a2 <= best) and best == best:
                    best, k = a2, 2
                if not (a3 <= best) and best == best:
                    best, k = a3, 3
                y[bu, cu, r, q] = best
                idx[bu, cu, r, q] = k
    return y, idx


@parallel_twin
def maxpool_forward(x, size, stride, y, idx):  # pragma: no cover - compiled
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
                        if not (v <= best) and best == best:  # first NaN wins
                            best = v
                            k = i * size + j
                y[bu, cu, r, q] = best
                idx[bu, cu, r, q] = k
    return y, idx


@parallel_twin
def maxpool_backward(dy, idx, size, stride, dx):  # pragma: no cover - compiled
    """General windows (overlapping or not): zero the plane, then add at the argmaxes."""
    n, c, h, w = dx.shape
    _, _, oh, ow = dy.shape
    su = U(stride)
    di = np.empty(size * size, dtype=np.uint64)  # window offset -> (row, column)
    dj = np.empty(size * size, dtype=np.uint64)
    for k in range(size * size):
        di[k] = k // size
        dj[k] = k % size
    for t in prange(n * c):
        bu = U(t // c)
        cu = U(t % c)
        for row in range(U(h)):
            for col in range(U(w)):
                dx[bu, cu, row, col] = 0
        for r in range(U(oh)):
            for q in range(U(ow)):
                k = idx[bu, cu, r, q]
                dx[bu, cu, r * su + di[k], q * su + dj[k]] += dy[bu, cu, r, q]
    return dx


@nb.njit(**JIT)
def _unpool2x2(dyf, idf, dxf, oh, ow, h, w, t0, t1):  # pragma: no cover - compiled
    """Planes [t0, t1) of ``maxpool2x2_backward``, on flat views."""
    hw, ohw, wu, owu = U(h * w), U(oh * ow), U(w), U(ow)
    one, two = U(1), U(2)
    for t in range(U(t0), U(t1)):
        dbase = t * hw
        ybase = t * ohw
        for r in range(U(oh)):
            yrow = ybase + r * owu
            for di in range(two):
                drow = dbase + (r * two + di) * wu
                k0 = di * two
                for q in range(owu):
                    k = U(idf[yrow + q])
                    g = dyf[yrow + q]
                    dxf[drow + q * two] = g if k == k0 else 0.0
                    dxf[drow + q * two + one] = g if k == k0 + one else 0.0
                for col in range(two * owu, wu):  # floor mode: columns no window covers
                    dxf[drow + col] = 0
        for i in range(dbase + two * U(oh) * wu, dbase + hw):  # ... and rows
            dxf[i] = 0


@parallel_twin
def maxpool2x2_backward(dy, idx, dx, chunks):  # pragma: no cover - compiled
    """2x2, stride 2: every dx element written once, on flat views (2x faster than zeroing);
    ``chunks`` runs of planes."""
    n, c, h, w = dx.shape
    _, _, oh, ow = dy.shape
    dxf, dyf, idf = dx.reshape(-1), dy.reshape(-1), idx.reshape(-1)
    step = (n * c + chunks - 1) // chunks
    for t in prange(chunks):
        _unpool2x2(dyf, idf, dxf, oh, ow, h, w, t * step, min(n * c, (t + 1) * step))
    return dx


@nb.njit(inline="always", **JIT)
def _relu_pool_plane(row, src, bc, yf, idf, dst, ph, pw, zero):  # pragma: no cover - compiled
    """yf[dst:], idf[dst:] = the 2x2 max-pool of relu(row[src:] + bc), a (2*PH, 2*PW) plane
    pooled before its ReLU (the bias is constant and the ReLU monotone: the same values)."""
    owu, one, two = U(2 * pw), U(1), U(2)
    for r in range(U(ph)):
        top, o = src + r * two * owu, dst + r * U(pw)
        for q in range(U(pw)):
            t = top + q * two
            a0, a1 = row[t] + bc, row[t + one] + bc
            a2, a3 = row[t + owu] + bc, row[t + owu + one] + bc
            best, k = a0, 0  # the first maximum, the first NaN: as ``maxpool2x2``
            if not (a1 <= best) and best == best:
                best, k = a1, 1
            if not (a2 <= best) and best == best:
                best, k = a2, 2
            if not (a3 <= best) and best == best:
                best, k = a3, 3
            # every ReLU'd value 0 (NaN stays): the pool over them picks the first
            yf[o + q] = zero if best <= 0 else best
            idf[o + q] = 0 if best <= 0 else k


@parallel_twin
def conv_relu_pool2x2(yc, bias, y, idx, zero):  # pragma: no cover - compiled
    """y[n, c] = 2x2 max-pool of relu(yc[c, n*P:(n+1)*P] + bias[c]), P = 4*PH*PW."""
    c = y.shape[1]
    yf, idf = y.reshape(-1), idx.reshape(-1)
    for ci in prange(c):
        _relu_pool_channel(yc[U(ci)], bias[U(ci)], yf, idf, ci, y.shape, zero)
    return y, idx


@nb.njit(**JIT)
def _relu_pool_channel(row, bc, yf, idf, ci, shape, zero):  # pragma: no cover - compiled
    n, c, ph, pw = shape
    pp = U(ph * pw)
    for b in range(U(n)):
        dst = (b * U(c) + U(ci)) * pp
        _relu_pool_plane(row, b * U(4) * pp, bc, yf, idf, dst, ph, pw, zero)


@nb.njit(inline="always", **JIT)
def _unpool_relu_plane(dyf, yf, idf, src, row, dst, ph, pw, zero):  # pragma: no cover - compiled
    """``_relu_pool_plane``'s adjoint: row[dst:] (2*PH, 2*PW) = dL/dz from the pooled plane
    at ``src``, each value written once, a row at a time."""
    owu, one, two = U(2 * pw), U(1), U(2)
    for r in range(U(ph)):
        o = src + r * U(pw)
        for di in range(two):
            d, k0 = dst + (r * two + di) * owu, di * two
            for q in range(U(pw)):
                g = dyf[o + q] if yf[o + q] > 0 else zero
                k = U(idf[o + q])
                row[d + q * two] = g if k == k0 else zero
                row[d + q * two + one] = g if k == k0 + one else zero


@nb.njit(**JIT)
def _unpool_relu_channels(dy, y, idx, out, db, zero, c0, c1):  # pragma: no cover - compiled
    """Channels [c0, c1) of ``conv_relu_pool2x2_grad``."""
    n, c, ph, pw = dy.shape
    dyf, yf, idf, pp = dy.reshape(-1), y.reshape(-1), idx.reshape(-1), U(ph * pw)
    for ci in range(c0, c1):
        row = out[U(ci)]
        for b in range(U(n)):
            src = (b * U(c) + U(ci)) * pp
            _unpool_relu_plane(dyf, yf, idf, src, row, b * U(4) * pp, ph, pw, zero)
        db[U(ci)] = _sum(row) if row.shape[0] > 0 else zero


# Runs of channels a task, each a serial call: the loops written in the ``prange`` took twice
# the CPU time on 2 threads (1.31 against 0.76 ms for the CNN's second convolution).
@parallel_twin
def conv_relu_pool2x2_grad(dy, y, idx, out, db, zero, chunks):  # pragma: no cover - compiled
    """out[c, n*P:(n+1)*P] = dL/dz of ``conv_relu_pool2x2`` from the pooled dy, and db[c] the
    sum of out's row c (as ``conv_output_grad`` sums it: the same bits)."""
    c = dy.shape[1]
    step = (c + chunks - 1) // chunks
    for t in prange(chunks):
        _unpool_relu_channels(dy, y, idx, out, db, zero, t * step, min(c, (t + 1) * step))
    return out, db


@parallel_twin
def dropout_mask(ids, base, threshold, scale, out):  # pragma: no cover - compiled
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


# -- direct convolution: few input channels (``Kernels.conv_direct_pays``) ---------------------
# With T = C_in*kh*kw taps, im2col's GEMM has K = T: for small T its memory passes cost more
# than its arithmetic. Here one sample's columns (T, P) are built at a time, in cache, and every
# output plane is summed from them in the (N, C, P) layout the next layer reads.


# one sample's columns, built inside a direct convolution's task
_im2col_serial = im2col.serial


@nb.njit(**JIT)
def _axpy(acc, src, wv):  # pragma: no cover - compiled
    """acc += wv * src."""
    for p in range(U(acc.shape[0])):
        acc[p] += wv * src[p]


# a dot product's float additions reassociated (no other fast-math): vectorised, 8-16x
@nb.njit(nogil=True, cache=True, error_model="numpy", fastmath={"reassoc"})
def _dot(g, src):  # pragma: no cover - compiled
    """sum of g * src (g is not empty: the sum starts from its first term)."""
    s = g[0] * src[0]
    for p in range(U(1), U(g.shape[0])):
        s += g[p] * src[p]
    return s


@nb.njit(nogil=True, cache=True, error_model="numpy", fastmath={"reassoc"})
def _sum(g):  # pragma: no cover - compiled
    s = g[0]
    for p in range(U(1), U(g.shape[0])):
        s += g[p]
    return s


# Nine taps (one input channel, 3x3: the common first layer) in one pass, loads shared
@nb.njit(**JIT)
def _out9(out, cols, w, bo, relu):  # pragma: no cover - compiled
    """out = bo + w @ cols for 9 rows of ``cols``, ReLU'd where ``relu``."""
    c0, c1, c2, c3, c4 = cols[0], cols[1], cols[2], cols[3], cols[4]
    c5, c6, c7, c8 = cols[5], cols[6], cols[7], cols[8]
    w0, w1, w2, w3, w4, w5, w6, w7, w8 = w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7], w[8]
    for p in range(U(out.shape[0])):
        v = bo + (
            w0 * c0[p] + w1 * c1[p] + w2 * c2[p] + w3 * c3[p] + w4 * c4[p]
            + w5 * c5[p] + w6 * c6[p] + w7 * c7[p] + w8 * c8[p]
        )  # fmt: skip
        out[p] = (0 if v <= 0 else v) if relu else v


@nb.njit(nogil=True, cache=True, error_model="numpy", fastmath={"reassoc"})
def _dots9(g, cols, dw):  # pragma: no cover - compiled
    """dw[k] += g . cols[k] for 9 rows; returns sum(g): one pass over ``g`` (a ReLU's select
    inside this loop stops its vectorisation: 2x slower)."""
    c0, c1, c2, c3, c4 = cols[0], cols[1], cols[2], cols[3], cols[4]
    c5, c6, c7, c8 = cols[5], cols[6], cols[7], cols[8]
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = s8 = sg = dw[0] - dw[0]
    for p in range(U(g.shape[0])):
        gp = g[p]
        sg += gp
        s0 += gp * c0[p]
        s1 += gp * c1[p]
        s2 += gp * c2[p]
        s3 += gp * c3[p]
        s4 += gp * c4[p]
        s5 += gp * c5[p]
        s6 += gp * c6[p]
        s7 += gp * c7[p]
        s8 += gp * c8[p]
    dw[0] += s0
    dw[1] += s1
    dw[2] += s2
    dw[3] += s3
    dw[4] += s4
    dw[5] += s5
    dw[6] += s6
    dw[7] += s7
    dw[8] += s8
    return sg


@nb.njit(inline="always", **JIT)
def _direct_plane(out, cols, wo, bo, code):  # pragma: no cover - compiled
    """out = act(bo + wo @ cols): one output plane, flat, from one sample's columns."""
    taps = wo.shape[0]
    if taps == 9 and code <= 1:
        _out9(out, cols, wo, bo, code == 1)
        return
    c0, w0 = cols[0], wo[0]
    for p in range(U(out.shape[0])):
        out[p] = bo + w0 * c0[p]
    for k in range(U(1), U(taps)):
        _axpy(out, cols[k], wo[k])
    if code == 1:  # the common case, kept branch-free for the vectoriser
        for p in range(U(out.shape[0])):
            v = out[p]
            out[p] = 0 if v <= 0 else v  # NaN stays NaN
    elif code != 0:
        for p in range(U(out.shape[0])):
            out[p] = apply_act(out[p], code)


@parallel_twin
def conv_direct(x, w2, b, kh, kw, stride, pad, y, chunks, code):  # pragma: no cover - compiled
    """y[n, o, :] = act(b[o] + w2[o] @ (sample n's columns)); y is (N, C_out, P)."""
    n = x.shape[0]
    taps = w2.shape[1]
    _, co, oh, ow = y.shape
    step = (n + chunks - 1) // chunks
    for t in prange(chunks):
        cols = np.empty((taps, oh * ow), dtype=x.dtype)
        for bi in range(t * step, min(n, (t + 1) * step)):
            _im2col_serial(x[bi : bi + 1], kh, kw, stride, pad, oh, ow, cols, 1)
            for ou in range(U(co)):
                _direct_plane(y[U(bi), ou].reshape(oh * ow), cols, w2[ou], b[ou], code)
    return y


@nb.njit(**JIT)
def _pool_plane(plane, yf, idf, dst, ph, pw, zero):  # pragma: no cover - compiled
    """A ReLU'd plane pooled, as a call: inlined in the ``prange``, 1.46 against 1.28 ms for
    the CNN's first convolution (1 thread)."""
    _relu_pool_plane(plane, U(0), zero, yf, idf, dst, ph, pw, zero)


@parallel_twin
def conv_direct_relu_pool(  # pragma: no cover - compiled
    x, w2, b, kh, kw, stride, pad, y, idx, chunks, zero
):
    """``conv_direct`` with ReLU, each plane 2x2 max-pooled while in cache into ``y`` and
    ``idx`` (N, C_out, PH, PW): the full-size output is never written."""
    n = x.shape[0]
    taps = w2.shape[1]
    _, co, ph, pw = y.shape
    oh, ow, pp = 2 * ph, 2 * pw, U(ph * pw)
    yf, idf = y.reshape(-1), idx.reshape(-1)
    step = (n + chunks - 1) // chunks
    for t in prange(chunks):
        cols = np.empty((taps, oh * ow), dtype=x.dtype)
        plane = np.empty(oh * ow, dtype=x.dtype)
        for bi in range(t * step, min(n, (t + 1) * step)):
            _im2col_serial(x[bi : bi + 1], kh, kw, stride, pad, oh, ow, cols, 1)
            for ou in range(U(co)):
                _direct_plane(plane, cols, w2[ou], b[ou], 1)
                dst = (U(bi) * U(co) + ou) * pp
                _pool_plane(plane, yf, idf, dst, ph, pw, zero)
    return y, idx


@nb.njit(inline="always", **JIT)
def _direct_plane_grads(g, cols, dcols, w2, pdw, pdb, t, ou, need_dx):  # pragma: no cover
    """Plane ``ou``'s dL/dz ``g``: its weight and bias gradients added into task ``t``'s
    ``pdw`` and ``pdb``, its columns' gradient into ``dcols`` where ``need_dx``."""
    taps = w2.shape[1]
    if taps == 9:
        pdb[t, ou] += _dots9(g, cols, pdw[t, ou])
    else:
        pdb[t, ou] += _sum(g)
        for k in range(U(taps)):
            pdw[t, ou, k] += _dot(g, cols[k])
    if need_dx:
        for k in range(U(taps)):
            _axpy(dcols[k], g, w2[ou, k])


@parallel_twin
def conv_direct_backward(  # pragma: no cover - compiled
    dy, x, y, w2, kh, kw, stride, pad, code, dx, pdw, pdb
):
    """Per batch chunk (``pdw``'s and ``pdb``'s first axis): the partial weight and bias
    gradients, and where ``dx`` has samples, their input gradients (one task's: no races)."""
    n = x.shape[0]
    taps = w2.shape[1]
    _, co, oh, ow = dy.shape
    p_count = oh * ow
    chunks = pdw.shape[0]
    step = (n + chunks - 1) // chunks
    need_dx = dx.shape[0] > 0
    for t in prange(chunks):
        cols = np.empty((taps, p_count), dtype=x.dtype)
        dcols = np.empty((taps, p_count), dtype=x.dtype)
        g = np.empty(p_count, dtype=x.dtype)
        for bi in range(t * step, min(n, (t + 1) * step)):
            bu = U(bi)
            _im2col_serial(x[bi : bi + 1], kh, kw, stride, pad, oh, ow, cols, 1)
            if need_dx:
                dcols[...] = 0
            for ou in range(U(co)):
                dyp = dy[bu, ou].reshape(p_count)
                yp = y[bu, ou].reshape(p_count)
                if code == 0:
                    for p in range(U(p_count)):
                        g[p] = dyp[p]
                elif code == 1:
                    for p in range(U(p_count)):
                        g[p] = dyp[p] if yp[p] > 0 else 0
                else:
                    for p in range(U(p_count)):
                        g[p] = apply_act_grad(dyp[p], yp[p], code)
                _direct_plane_grads(g, cols, dcols, w2, pdw, pdb, t, ou, need_dx)
            if need_dx:
                _sample_col2im(dcols, bi, kh, kw, stride, pad, oh, ow, dx)
    return pdw, pdb


@parallel_twin
def conv_direct_relu_pool_backward(  # pragma: no cover - compiled
    dy, x, y, idx, w2, kh, kw, stride, pad, dx, pdw, pdb, zero
):
    """``conv_direct_backward`` of ``conv_direct_relu_pool`` from the pooled dy, ``y`` and
    ``idx``: each plane's dL/dz formed in cache (only an argmax passes a gradient)."""
    n = x.shape[0]
    taps = w2.shape[1]
    _, co, ph, pw = dy.shape
    oh, ow, pp = 2 * ph, 2 * pw, U(ph * pw)
    dyf, yf, idf = dy.reshape(-1), y.reshape(-1), idx.reshape(-1)
    chunks = pdw.shape[0]
    step = (n + chunks - 1) // chunks
    need_dx = dx.shape[0] > 0
    for t in prange(chunks):
        cols = np.empty((taps, oh * ow), dtype=x.dtype)
        dcols = np.empty((taps, oh * ow), dtype=x.dtype)
        g = np.empty(oh * ow, dtype=x.dtype)
        for bi in range(t * step, min(n, (t + 1) * step)):
            _im2col_serial(x[bi : bi + 1], kh, kw, stride, pad, oh, ow, cols, 1)
            if need_dx:
                dcols[...] = 0
            for ou in range(U(co)):
                src = (U(bi) * U(co) + ou) * pp
                _unpool_relu_plane(dyf, yf, idf, src, g, U(0), ph, pw, zero)
                _direct_plane_grads(g, cols, dcols, w2, pdw, pdb, t, ou, need_dx)
            if need_dx:
                _sample_col2im(dcols, bi, kh, kw, stride, pad, oh, ow, dx)
    return pdw, pdb


@nb.njit(**JIT)
def _sample_col2im(dcols, b, kh, kw, stride, pad, oh, ow, dx):  # pragma: no cover - compiled
    """dx[b] = the adjoint of ``im2col`` of sample ``b`` alone: each column entry added back
    where it came from."""
    _, c, h, w = dx.shape
    su = U(stride)
    bu = U(b)
    for ci in range(U(c)):
        for hh in range(U(h)):
            for q in range(U(w)):
                dx[bu, ci, hh, q] = 0
        for i in range(kh):
            for j in range(kw):
                k, first, lou, cnt = _tap(ci, i, j, kh, kw, stride, pad, w, ow)
                row = dcols[k]
                for r in range(oh):
                    hh = r * stride + i - pad
                    if hh < 0 or hh >= h:
                        continue
                    dst = dx[bu, ci, U(hh)]
                    o = U(r * ow) + lou
                    if stride == 1:
                        for q in range(cnt):
                            dst[first + q] += row[o + q]
                    else:
                        for q in range(cnt):
                            dst[first + q * su] += row[o + q]
