"""CuPy kernels: the same fusions as the Numba backend, as CUDA elementwise/raw kernels.

Built lazily on first use (CuPy compiles and caches them), so importing this module costs
nothing on a machine without a GPU.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from xpnn.backends.cupy_conv import CupyConvKernels

Array = Any
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
def _bias_act_kernel(act: str) -> Any:
    import cupy as cp

    return cp.ElementwiseKernel(
        "raw T b, int32 m", "T z", f"T v = z + b[i % m]; z = {_ACT_EXPR[act]};", f"xpnn_bias_{act}"
    )


@cache
def _act_grad_kernel(act: str) -> Any:
    import cupy as cp

    return cp.ElementwiseKernel("T y", "T dy", f"dy = {_GRAD_EXPR[act]};", f"xpnn_grad_{act}")


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
        // a label outside [0, k) (unchecked on the host: that would sync) must not read
        // outside the row: the row's loss and gradient become NaN instead
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


@cache
def _adam_kernel() -> Any:
    import cupy as cp

    return cp.ElementwiseKernel(
        "T g, T lr_c1, T beta1, T beta2, T eps, T c2",
        "T p, T m, T v",
        """
        m = beta1 * m + ((T)1 - beta1) * g;
        v = beta2 * v + ((T)1 - beta2) * g * g;
        p -= lr_c1 * m / (sqrt(v / c2) + eps);
        """,
        "xpnn_adam",
    )


@cache
def _momentum_kernel() -> Any:
    import cupy as cp

    return cp.ElementwiseKernel(
        "T g, T lr, T mu", "T p, T v", "v = mu * v + g; p -= lr * v;", "xpnn_momentum"
    )


class CupyKernels(CupyConvKernels):
    """NumPy-API kernels on CuPy arrays, with the hot ones fused into CUDA kernels."""

    def bias_act(self, z: Array, b: Array, act: str) -> Array:
        return _bias_act_kernel(act)(b, b.shape[0], z)

    def bias_act_backward(self, dy: Array, y: Array, act: str) -> tuple[Array, Array]:
        dz = _act_grad_kernel(act)(y, dy)
        return dz, dz.sum(axis=0)

    def softmax_cross_entropy(
        self, logits: Array, labels: Array, scale: float
    ) -> tuple[Array, Array]:
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

    def momentum_update(self, p: Array, g: Any, v: Array, lr: float, mu: float) -> None:
        t = p.dtype.type
        _momentum_kernel()(self.summed(g), t(lr), t(mu), p, v)

    def adam_update(self, p, g, m, v, lr, beta1, beta2, eps, step) -> None:  # noqa: ANN001
        t = p.dtype.type
        c1, c2 = 1 - beta1**step, 1 - beta2**step
        _adam_kernel()(self.summed(g), t(lr / c1), t(beta1), t(beta2), t(eps), t(c2), p, m, v)
