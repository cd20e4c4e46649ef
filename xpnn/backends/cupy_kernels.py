"""CuPy kernels: the Numba backend's fusions in CUDA, built on first use; one thread an output,
col2im and the max-pool backward gathering in NumPy's (i, j) order: no atomics, deterministic."""

from functools import cache
from typing import Any

import numpy as np

from xpnn.backends.common import conv_out_hw, dropout_threshold, host_or_device, mask_rows, step_key
from xpnn.backends.kernels import Kernels
from xpnn.backends.numpy_kernels import NumpyKernels


@cache
def elementwise(params: str, outputs: str, body: str, name: str, preamble: str = "") -> Any:
    """A CuPy ``ElementwiseKernel``, built once, on first use: CuPy is imported only then."""
    import cupy as cp

    return cp.ElementwiseKernel(params, outputs, body, name, preamble=preamble)


_ACT_EXPR = {
    "identity": "v",
    "relu": "(v <= 0 ? (T)0 : v)",  # NaN stays NaN, as on NumPy
    "sigmoid": "(v >= 0 ? (T)1 / ((T)1 + exp(-v)) : exp(v) / ((T)1 + exp(v)))",
    "tanh": "tanh(v)",
}
_GRAD_EXPR = {
    "identity": "dy",
    "relu": "(y > 0 ? dy : (T)0)",
    "sigmoid": "dy * y * ((T)1 - y)",
    "tanh": "dy * ((T)1 - y * y)",
}


@cache
def _softmax_xent_kernel() -> Any:
    """One thread block per row: max, sum of exp, loss and gradient in one launch."""
    import cupy as cp

    code = r"""
    template<typename T>
    __global__ void xpnn_softmax_xent(const T* z, const long long* labels, T* grad,
                                      double* loss, int n, int k, T scale) {
        int row = blockIdx.x;
        if (row >= n) return;
        const T* zr = z + (long long)row * k;
        T* gr = grad + (long long)row * k;
        __shared__ double red[256];
        double mx = -1e308;
        for (int j = threadIdx.x; j < k; j += blockDim.x) mx = max(mx, (double)zr[j]);
        red[threadIdx.x] = mx; __syncthreads();
        for (int s = blockDim.x / 2; s > 0; s >>= 1) {
            if (threadIdx.x < s) red[threadIdx.x] = max(red[threadIdx.x], red[threadIdx.x + s]);
            __syncthreads();
        }
        mx = red[0]; __syncthreads();
        double sum = 0.0;
        for (int j = threadIdx.x; j < k; j += blockDim.x) sum += exp((double)zr[j] - mx);
        red[threadIdx.x] = sum; __syncthreads();
        for (int s = blockDim.x / 2; s > 0; s >>= 1) {
            if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
            __syncthreads();
        }
        sum = red[0];
        long long lab = labels[row];
        // a label outside [0, k) (a host check would sync) makes the row's loss and gradient NaN
        bool bad = lab < 0 || lab >= k;
        double nan = __longlong_as_double(0x7ff8000000000000LL);
        for (int j = threadIdx.x; j < k; j += blockDim.x) {
            double p = exp((double)zr[j] - mx) / sum;
            gr[j] = bad ? (T)nan : (T)((p - (j == lab ? 1.0 : 0.0)) * (double)scale);
        }
        if (threadIdx.x == 0) atomicAdd(loss, bad ? nan : log(sum) + mx - (double)zr[lab]);
    }
    """
    return cp.RawModule(
        code=code,
        options=("-std=c++14",),
        name_expressions=("xpnn_softmax_xent<float>", "xpnn_softmax_xent<double>"),
    )


_FLUSH = "(x < tiny && x > -tiny) ? (T)0 : x"
_ADAM = f"""
T x = beta1 * m + ((T)1 - beta1) * g;
m = {_FLUSH};
x = beta2 * v + ((T)1 - beta2) * (g * g);
v = {_FLUSH};
p = decay * p - lr_c1 * (m / (sqrt(v / c2) + eps));
"""


def _i32(*values: int) -> tuple[np.int32, ...]:
    return tuple(np.int32(v) for v in values)


# one thread per score: its row's seen keys ``j <= i`` in two passes, the rest set to 0
_ROW = "long long t = _ind.size() / n_rows; long long r = i / t, c = i % t; long long q = r % t;"
_CAUSAL_SOFTMAX = """
const T* srow = &s[r * t];
if (c > q) { p = (T)0; } else {
    T m = srow[0];
    for (long long j = 1; j <= q; ++j) m = srow[j] > m ? srow[j] : m;
    T total = 0;
    for (long long j = 0; j <= q; ++j) total += exp(srow[j] - m);
    p = exp(srow[c] - m) / total;
}"""
_CAUSAL_SOFTMAX_BACKWARD = """
if (c > q) { ds = (T)0; } else {
    T dot = 0;
    for (long long j = 0; j <= q; ++j) dot += dp[r * t + j] * p[r * t + j];
    ds = p[i] * (dp[i] - dot);
}"""


_GEOMETRY = (
    "int32 c, int32 h, int32 w, int32 kh, int32 kw, int32 stride, int32 pad, "
    "int32 oh, int32 ow, int64 ncols"
)

_IM2COL = (
    "raw T x, " + _GEOMETRY,
    "T col",
    """
    long long row = i / ncols;
    long long pos = i - row * ncols;
    long long p = (long long)oh * ow;
    long long b = pos / p;
    int r = (int)(pos - b * p);
    int y = r / ow, q = r - (r / ow) * ow;
    int j = (int)(row % kw);
    int t = (int)(row / kw);
    int ii = t % kh, ci = t / kh;
    int hh = y * stride + ii - pad, ww = q * stride + j - pad;
    col = (hh >= 0 && hh < h && ww >= 0 && ww < w)
        ? x[((b * c + ci) * h + hh) * (long long)w + ww] : (T)0;
    """,
    "xpnn_im2col",
)

_COL2IM = (
    "raw T cols, " + _GEOMETRY,
    "T dx",
    """
    int ww = (int)(i % w);
    long long t = i / w;
    int hh = (int)(t % h);
    t /= h;
    int ci = (int)(t % c);
    long long b = t / c;
    long long base = b * oh * ow;
    T acc = 0;
    for (int ii = 0; ii < kh; ++ii) {
        int yy = hh + pad - ii;
        if (yy < 0 || yy % stride != 0) continue;
        int y = yy / stride;
        if (y >= oh) continue;
        for (int j = 0; j < kw; ++j) {
            int qq = ww + pad - j;
            if (qq < 0 || qq % stride != 0) continue;
            int q = qq / stride;
            if (q >= ow) continue;
            long long row = (long long)(ci * kh + ii) * kw + j;
            acc += cols[row * ncols + base + (long long)y * ow + q];
        }
    }
    dx = acc;
    """,
    "xpnn_col2im",
)

_MAXPOOL = (
    "raw T x, int32 h, int32 w, int32 oh, int32 ow, int32 ksize, int32 stride",
    "T y, int32 idx",
    """
    int q = (int)(i % ow);
    long long t = i / ow;
    int r = (int)(t % oh);
    long long plane = t / oh;
    long long base = (plane * h + (long long)r * stride) * w + (long long)q * stride;
    T best = x[base];
    int k = 0;
    for (int ii = 0; ii < ksize; ++ii) {
        for (int j = 0; j < ksize; ++j) {
            T v = x[base + (long long)ii * w + j];
            // "not <=" holds for a NaN and a NaN best stays: the first NaN wins (np.argmax)
            if (!(v <= best) && best == best) { best = v; k = ii * ksize + j; }
        }
    }
    y = best;
    idx = k;
    """,
    "xpnn_maxpool_forward",
)

_MAXPOOL_BACKWARD = (
    "raw T dy, raw int32 idx, int32 h, int32 w, int32 oh, int32 ow, int32 ksize, int32 stride",
    "T dx",
    """
    int ww = (int)(i % w);
    long long t = i / w;
    int hh = (int)(t % h);
    long long plane = t / h;
    int r_lo = hh - ksize + 1;
    r_lo = r_lo > 0 ? (r_lo + stride - 1) / stride : 0;
    int r_hi = min(hh / stride, oh - 1);
    int q_lo = ww - ksize + 1;
    q_lo = q_lo > 0 ? (q_lo + stride - 1) / stride : 0;
    int q_hi = min(ww / stride, ow - 1);
    T acc = 0;
    for (int r = r_lo; r <= r_hi; ++r) {
        for (int q = q_lo; q <= q_hi; ++q) {
            long long o = (plane * oh + r) * ow + q;
            if (idx[o] == (hh - r * stride) * ksize + (ww - q * stride)) acc += dy[o];
        }
    }
    dx = acc;
    """,
    "xpnn_maxpool_backward",
)

_FMIX32 = """
__device__ __forceinline__ unsigned int xpnn_fmix32(unsigned int h) {
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    return h;
}
"""

_DROPOUT = (
    "raw int64 ids, uint32 base, uint32 thr, T scale, int64 f",
    "T mask",
    """
    long long b = i / f;
    unsigned int e = (unsigned int)(i - b * f);
    long long sid = ids[b];
    unsigned int lo = (unsigned int)(sid & 0xffffffffLL);
    unsigned int hi = (unsigned int)(((unsigned long long)sid) >> 32);
    unsigned int s = xpnn_fmix32(base ^ xpnn_fmix32(lo + 0x9E3779B9u));
    s = xpnn_fmix32(s ^ xpnn_fmix32(hi + 0x9E3779B9u));
    unsigned int hsh = xpnn_fmix32(s ^ xpnn_fmix32(e + 0x9E3779B9u));
    mask = hsh >= thr ? scale : (T)0;
    """,
    "xpnn_dropout_mask",
    _FMIX32,
)


class CupyKernels(Kernels):
    """NumPy's ``out=`` versions where CuPy runs them as one kernel, the hot ones fused."""

    matmul_into = NumpyKernels.matmul_into
    _activate_in_place = NumpyKernels._activate_in_place
    one_hot = NumpyKernels.one_hot
    pick = NumpyKernels.pick
    sum_rows = NumpyKernels.sum_rows
    conv_output = NumpyKernels.conv_output
    conv_output_grad = NumpyKernels.conv_output_grad

    def bias_act(self, z, b, act):
        body = f"T v = z + b[i % m]; z = {_ACT_EXPR[act]};"
        kernel = elementwise("raw T b, int32 m", "T z", body, f"xpnn_bias_{act}")
        return kernel(b, b.shape[0], z)

    def bias_act_backward(self, dy, y, act):
        dz = elementwise("T y", "T dy", f"dy = {_GRAD_EXPR[act]};", f"xpnn_grad_{act}")(y, dy)
        return dz, dz.sum(axis=0)

    def softmax_cross_entropy(self, logits, labels, scale):
        self.check_labels(logits, labels)  # shape and dtype; the range is checked in the kernel
        cp = self.xp
        z = cp.ascontiguousarray(logits)
        n, k = z.shape
        grad = cp.empty_like(z)
        loss = cp.zeros((), dtype=cp.float64)
        if n == 0:
            return loss, grad
        ctype = "float" if z.dtype == cp.float32 else "double"
        fn = _softmax_xent_kernel().get_function(f"xpnn_softmax_xent<{ctype}>")
        labels = cp.ascontiguousarray(labels, dtype=cp.int64)
        fn((n,), (128,), (z, labels, grad, loss, cp.int32(n), cp.int32(k), z.dtype.type(scale)))
        return loss, grad

    def momentum_update(self, p, g, v, lr, mu):
        t = p.dtype.type
        lr = host_or_device(p.dtype, lr)  # a replayed step's rate is a 0-d device array
        body = f"T x = mu * v + g; v = {_FLUSH}; p -= lr * v;"
        kernel = elementwise("T g, T lr, T mu, T tiny", "T p, T v", body, "xpnn_momentum")
        kernel(g, lr, t(mu), t(np.finfo(p.dtype).smallest_normal), p, v)

    def adam_step(self, p, g, m, v, lr_c1, beta1, beta2, eps, c2, decay=1.0):
        t = p.dtype.type
        lr_c1, c2, decay = (host_or_device(p.dtype, x) for x in (lr_c1, c2, decay))
        scalars = (lr_c1, t(beta1), t(beta2), t(eps), c2, decay)
        params = "T g, T lr_c1, T beta1, T beta2, T eps, T c2, T decay, T tiny"
        kernel = elementwise(params, "T p, T m, T v", _ADAM, "xpnn_adam")
        kernel(g, *scalars, t(np.finfo(p.dtype).smallest_normal), p, m, v)

    def _geometry(self, x_shape, kh, kw, stride, padding, out_hw):  # noqa: ANN001, ANN202
        n, c, h, w = x_shape
        oh, ow = conv_out_hw(x_shape, kh, kw, stride, padding, out_hw)
        return oh, ow, (*_i32(c, h, w, kh, kw, stride, padding, oh, ow), np.int64(n * oh * ow))

    def im2col(self, x, kh, kw, stride, padding, out=None, out_hw=None):
        cp = self.xp
        x = cp.ascontiguousarray(x)
        n, c = x.shape[:2]
        oh, ow, geom = self._geometry(x.shape, kh, kw, stride, padding, out_hw)
        if out is None:
            out = cp.empty((c * kh * kw, n * oh * ow), dtype=x.dtype)
        return elementwise(*_IM2COL)(x, *geom, out)

    def col2im(self, cols, x_shape, kh, kw, stride, padding, out_hw=None):
        cp = self.xp
        _, _, geom = self._geometry(x_shape, kh, kw, stride, padding, out_hw)
        dx = cp.empty(tuple(x_shape), dtype=cols.dtype)
        return elementwise(*_COL2IM)(cp.ascontiguousarray(cols), *geom, dx)

    def maxpool2d_forward(self, x, size, stride):
        cp = self.xp
        x = cp.ascontiguousarray(x)
        n, c, h, w = x.shape
        oh, ow = conv_out_hw(x.shape, size, size, stride, 0)
        y = cp.empty((n, c, oh, ow), dtype=x.dtype)
        idx = cp.empty((n, c, oh, ow), dtype=cp.int32)
        return elementwise(*_MAXPOOL)(x, *_i32(h, w, oh, ow, size, stride), y, idx)  # (y, idx)

    def maxpool2d_backward(self, dy, idx, x_shape, size, stride):
        cp = self.xp
        h, w = x_shape[2:]
        dx = cp.empty(tuple(x_shape), dtype=dy.dtype)
        dy, idx = cp.ascontiguousarray(dy), cp.ascontiguousarray(idx, dtype=cp.int32)
        elementwise(*_MAXPOOL_BACKWARD)(dy, idx, *_i32(h, w, *dy.shape[2:], size, stride), dx)
        return dx

    def dropout_mask(self, shape, p, seed, step, sample_ids, dtype, salt=0):
        cp = self.xp
        ids = cp.ascontiguousarray(cp.asarray(sample_ids), dtype=cp.int64)
        _, f = mask_rows(shape, ids)
        dtype = np.dtype(dtype)
        mask = cp.empty(tuple(shape), dtype=dtype)
        if mask.size:
            key = host_or_device(np.dtype(np.uint32), step_key(seed, step, salt))
            threshold = np.uint32(dropout_threshold(p))
            scale = dtype.type(1.0 / (1.0 - p))
            elementwise(*_DROPOUT)(ids, key, threshold, scale, np.int64(f), mask)
        return mask

    def embedding_grad(self, ids, dy, out):
        import cupyx

        out.fill(0)
        cupyx.scatter_add(out, ids, dy)  # atomic adds: NumPy's np.add.at is host-only
        return out

    def causal_softmax(self, scores):
        s = self.xp.ascontiguousarray(scores)
        params, name = "raw T s, int64 n_rows", "xpnn_causal_softmax"
        kernel = elementwise(params, "T p", _ROW + _CAUSAL_SOFTMAX, name)
        return kernel(s, s.size // s.shape[-1], self.xp.empty_like(s))

    def causal_softmax_backward(self, dp, p):
        dp, p = self.xp.ascontiguousarray(dp), self.xp.ascontiguousarray(p)
        params, name = "raw T dp, raw T p, int64 n_rows", "xpnn_causal_softmax_backward"
        kernel = elementwise(params, "T ds", _ROW + _CAUSAL_SOFTMAX_BACKWARD, name)
        return kernel(dp, p, p.size // p.shape[-1], self.xp.empty_like(p))
