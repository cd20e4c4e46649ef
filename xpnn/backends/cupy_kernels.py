"""CuPy kernels: the Numba backend's fusions as CUDA kernels, built lazily on first use."""

from functools import cache
from typing import Any

import numpy as np

from xpnn.backends import cupy_conv as conv
from xpnn.backends.common import conv_out_hw, dropout_threshold, host_or_device, mask_rows, step_key
from xpnn.backends.kernels import Kernels
from xpnn.backends.numpy_kernels import NumpyKernels

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
        kernel = conv.elementwise("raw T b, int32 m", "T z", body, f"xpnn_bias_{act}")
        return kernel(b, b.shape[0], z)

    def bias_act_backward(self, dy, y, act):
        dz = conv.elementwise("T y", "T dy", f"dy = {_GRAD_EXPR[act]};", f"xpnn_grad_{act}")(y, dy)
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
        kernel = conv.elementwise("T g, T lr, T mu, T tiny", "T p, T v", body, "xpnn_momentum")
        kernel(g, lr, t(mu), t(np.finfo(p.dtype).smallest_normal), p, v)

    def adam_step(self, p, g, m, v, lr_c1, beta1, beta2, eps, c2, decay=1.0):
        t = p.dtype.type
        lr_c1, c2, decay = (host_or_device(p.dtype, x) for x in (lr_c1, c2, decay))
        scalars = (lr_c1, t(beta1), t(beta2), t(eps), c2, decay)
        params = "T g, T lr_c1, T beta1, T beta2, T eps, T c2, T decay, T tiny"
        kernel = conv.elementwise(params, "T p, T m, T v", _ADAM, "xpnn_adam")
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
        conv.im2col_kernel()(x, *geom, out)
        return out

    def col2im(self, cols, x_shape, kh, kw, stride, padding, out_hw=None):
        cp = self.xp
        _, _, geom = self._geometry(x_shape, kh, kw, stride, padding, out_hw)
        dx = cp.empty(tuple(x_shape), dtype=cols.dtype)
        conv.col2im_kernel()(cp.ascontiguousarray(cols), *geom, dx)
        return dx

    def maxpool2d_forward(self, x, size, stride):
        cp = self.xp
        x = cp.ascontiguousarray(x)
        n, c, h, w = x.shape
        oh, ow = conv_out_hw(x.shape, size, size, stride, 0)
        y = cp.empty((n, c, oh, ow), dtype=x.dtype)
        idx = cp.empty((n, c, oh, ow), dtype=cp.int32)
        conv.maxpool_forward_kernel()(x, *_i32(h, w, oh, ow, size, stride), y, idx)
        return y, idx

    def maxpool2d_backward(self, dy, idx, x_shape, size, stride):
        cp = self.xp
        h, w = x_shape[2:]
        dx = cp.empty(tuple(x_shape), dtype=dy.dtype)
        dy, idx = cp.ascontiguousarray(dy), cp.ascontiguousarray(idx, dtype=cp.int32)
        conv.maxpool_backward_kernel()(dy, idx, *_i32(h, w, *dy.shape[2:], size, stride), dx)
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
            conv.dropout_kernel()(ids, key, threshold, scale, np.int64(f), mask)
        return mask

    def embedding_grad(self, ids, dy, out):
        import cupyx

        out.fill(0)
        cupyx.scatter_add(out, ids, dy)  # atomic adds: NumPy's np.add.at is host-only
        return out

    def causal_softmax(self, scores):
        s = self.xp.ascontiguousarray(scores)
        params, name = "raw T s, int64 n_rows", "xpnn_causal_softmax"
        kernel = conv.elementwise(params, "T p", _ROW + _CAUSAL_SOFTMAX, name)
        return kernel(s, s.size // s.shape[-1], self.xp.empty_like(s))

    def causal_softmax_backward(self, dp, p):
        dp, p = self.xp.ascontiguousarray(dp), self.xp.ascontiguousarray(p)
        params, name = "raw T dp, raw T p, int64 n_rows", "xpnn_causal_softmax_backward"
        kernel = conv.elementwise(params, "T ds", _ROW + _CAUSAL_SOFTMAX_BACKWARD, name)
        return kernel(dp, p, p.size // p.shape[-1], self.xp.empty_like(p))
