"""``CupyKernels``' convolution, pooling and dropout kernels: one thread per output element;
col2im and the max-pool backward gather in NumPy's (i, j) order: no atomics, deterministic."""

from functools import cache
from typing import Any

_GEOMETRY = (
    "int32 c, int32 h, int32 w, int32 kh, int32 kw, int32 stride, int32 pad, "
    "int32 oh, int32 ow, int64 ncols"
)


@cache
def elementwise(params: str, outputs: str, body: str, name: str, preamble: str = "") -> Any:
    """A CuPy ``ElementwiseKernel``, built once, on first use: CuPy is imported only then."""
    import cupy as cp

    return cp.ElementwiseKernel(params, outputs, body, name, preamble=preamble)


def im2col_kernel() -> Any:
    return elementwise(
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


def col2im_kernel() -> Any:
    return elementwise(
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


def maxpool_forward_kernel() -> Any:
    return elementwise(
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


def maxpool_backward_kernel() -> Any:
    return elementwise(
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


def dropout_kernel() -> Any:
    return elementwise(
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
        preamble=_FMIX32,
    )
