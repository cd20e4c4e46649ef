"""Convolution, max-pooling and dropout kernels: the generic array-API versions and NumPy's.

Layout (shared by every backend, so the layers never branch):

* ``im2col(x, kh, kw, stride, padding, out, out_hw)`` turns ``x`` (N, C, H, W) into ``cols``
  of shape (C*kh*kw, N*OH*OW): row ``(c, i, j)`` (the order of ``W.reshape(C_out, -1)``), column
  ``(n, oh, ow)``. A convolution is then *one* GEMM per layer, ``W2 @ cols`` (C_out, N*OH*OW),
  and the backward pass two more (``dY @ cols.T`` for dW, ``W2.T @ dY`` for dcols).
* ``conv_output(yc, b, shape, act)`` adds the bias, applies the activation and turns
  (C_out, N*P) into NCHW: a transpose of blocks of P = OH*OW contiguous values, fused with the
  elementwise work; ``conv_output_grad(dy, out, y, act)`` is its adjoint (``y`` is the
  activation's output) and also returns the bias gradient.
* ``col2im(cols, x_shape, kh, kw, stride, padding, out_hw)`` is the adjoint of ``im2col``; it
  may use ``cols`` as scratch.
* ``out_hw`` (default: every output the input allows) makes both compute only the first OH×OW
  output positions: a floor-mode max-pool after the convolution never reads the others, so
  they need neither computing nor a gradient (``Conv2D.limit_output``).
* ``maxpool2d_forward(x, size, stride) -> (y, idx)`` (floor mode; ``idx`` is the argmax's
  row-major offset inside the window, first maximum on ties); ``maxpool2d_backward`` routes
  ``dy`` back to those positions.
* ``dropout_mask(shape, p, seed, step, sample_ids, dtype, salt=0)``: ``0`` or ``1/(1-p)`` per
  element, from a counter-based hash of (seed, salt, step, sample id, element index) in uint32
  integer arithmetic, so every backend (and every rank, batch position or batch split) draws
  the bit-identical mask for the same sample.
"""

from __future__ import annotations

from typing import Any

Array = Any

# -- the dropout hash: murmur3's 32-bit finaliser, chained over the keys ---------------------
MASK32 = 0xFFFFFFFF
FMIX_M1 = 0x85EBCA6B
FMIX_M2 = 0xC2B2AE35
GOLDEN = 0x9E3779B9


def fmix32_host(h: int) -> int:
    """murmur3 fmix32 on a Python int (the host half of the key chain)."""
    h &= MASK32
    h ^= h >> 16
    h = (h * FMIX_M1) & MASK32
    h ^= h >> 13
    h = (h * FMIX_M2) & MASK32
    h ^= h >> 16
    return h


def mix_host(h: int, k: int) -> int:
    """``fmix32(h ^ fmix32(k + GOLDEN))``: a bijection in ``k`` for a fixed ``h``."""
    return fmix32_host(h ^ fmix32_host((k + GOLDEN) & MASK32))


def dropout_base_key(seed: int, step: int, salt: int = 0) -> int:
    """The per-(seed, salt, step) key, every 64-bit half mixed in; computed on the host."""
    h = 0
    for v in (seed, salt, step):
        v = int(v) & 0xFFFFFFFFFFFFFFFF
        h = mix_host(mix_host(h, v & MASK32), v >> 32)
    return h


def dropout_threshold(p: float) -> int:
    """Keep an element when its uint32 hash is ``>= threshold``: probability ~ 1 - p."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    return min(int(p * 4294967296.0), MASK32)


def conv_out_size(size: int, k: int, stride: int, padding: int) -> int:
    return (size + 2 * padding - k) // stride + 1


def conv_out_hw(
    x_shape: tuple[int, ...],
    kh: int,
    kw: int,
    stride: int,
    padding: int,
    out_hw: tuple[int, int] | None = None,
) -> tuple[int, int]:
    """The (OH, OW) a kernel computes: all that fit, or the first ``out_hw`` of them."""
    h, w = x_shape[-2:]
    oh, ow = conv_out_size(h, kh, stride, padding), conv_out_size(w, kw, stride, padding)
    if out_hw is None:
        return oh, ow
    if not (0 < out_hw[0] <= oh and 0 < out_hw[1] <= ow):
        raise ValueError(f"out_hw {tuple(out_hw)} outside the {oh}x{ow} outputs of {x_shape}")
    return int(out_hw[0]), int(out_hw[1])


def _window(start: int, count: int, stride: int) -> slice:
    """The slice of ``count`` positions ``start, start+stride, ...``."""
    return slice(start, start + stride * (count - 1) + 1, stride)


class ConvKernels:
    """Generic versions: array-API functions only (slicing loops over kernel offsets)."""

    xp: Any

    # -- convolution ------------------------------------------------------------------------
    def _padded(self, x: Array, padding: int) -> Array:
        if padding == 0:
            return x
        xp = self.xp
        n, c, h, w = x.shape
        xpad = xp.zeros((n, c, h + 2 * padding, w + 2 * padding), dtype=x.dtype)
        xpad[:, :, padding : padding + h, padding : padding + w] = x
        return xpad

    def im2col(
        self,
        x: Array,
        kh: int,
        kw: int,
        stride: int,
        padding: int,
        out: Array | None = None,
        out_hw: tuple[int, int] | None = None,
    ) -> Array:
        """(N, C, H, W) -> (C*kh*kw, N*OH*OW), written into ``out`` when given."""
        xp = self.xp
        n, c, h, w = x.shape
        oh, ow = conv_out_hw(x.shape, kh, kw, stride, padding, out_hw)
        xpad = self._padded(x, padding)
        parts = [
            xpad[:, :, _window(i, oh, stride), _window(j, ow, stride)]
            for i in range(kh)
            for j in range(kw)
        ]
        stacked = xp.stack(parts, axis=2)  # (N, C, kh*kw, OH, OW)
        cols = xp.reshape(xp.permute_dims(stacked, (1, 2, 0, 3, 4)), (c * kh * kw, n * oh * ow))
        if out is None:
            return cols
        out[...] = cols
        return out

    def col2im(
        self,
        cols: Array,
        x_shape: tuple[int, ...],
        kh: int,
        kw: int,
        stride: int,
        padding: int,
        out_hw: tuple[int, int] | None = None,
    ) -> Array:
        """The adjoint of ``im2col``: (C*kh*kw, N*OH*OW) -> (N, C, H, W), overlaps summed."""
        xp = self.xp
        n, c, h, w = x_shape
        oh, ow = conv_out_hw(x_shape, kh, kw, stride, padding, out_hw)
        d = xp.permute_dims(xp.reshape(cols, (c, kh, kw, n, oh, ow)), (3, 0, 1, 2, 4, 5))
        dx = xp.zeros((n, c, h + 2 * padding, w + 2 * padding), dtype=cols.dtype)
        for i in range(kh):
            for j in range(kw):
                sl = (slice(None), slice(None), _window(i, oh, stride), _window(j, ow, stride))
                dx[sl] = dx[sl] + d[:, :, i, j, :, :]
        if padding:
            dx = dx[:, :, padding : padding + h, padding : padding + w]
        return dx

    def conv_output(
        self, yc: Array, b: Array, shape: tuple[int, ...], act: str = "identity"
    ) -> Array:
        """act((C_out, N*P) GEMM result + bias) -> (N, C_out, OH, OW)."""
        xp = self.xp
        n, c, oh, ow = shape
        y = xp.permute_dims(xp.reshape(yc, (c, n, oh, ow)), (1, 0, 2, 3))
        return self.activation(y + xp.reshape(b, (1, c, 1, 1)), act)

    def conv_output_grad(
        self, dy: Array, out: Array | None = None, y: Array | None = None, act: str = "identity"
    ) -> tuple[Array, Array]:
        """(dL/d(GEMM result) as (C_out, N*P), written into ``out``; dL/db). ``y`` is the
        forward output (the activation's), needed unless ``act`` is the identity."""
        xp = self.xp
        if act != "identity":
            dy = self.activation_grad(dy, y, act)
        n, c, oh, ow = dy.shape
        dyc = xp.reshape(
            xp.permute_dims(xp.reshape(dy, (n, c, oh * ow)), (1, 0, 2)), (c, n * oh * ow)
        )
        if out is not None:
            out[...] = dyc
            dyc = out
        return dyc, xp.sum(dyc, axis=1)

    # -- max-pooling ------------------------------------------------------------------------
    def maxpool2d_forward(self, x: Array, size: int, stride: int) -> tuple[Array, Array]:
        xp = self.xp
        n, c, h, w = x.shape
        oh, ow = (h - size) // stride + 1, (w - size) // stride + 1
        parts = [
            x[:, :, _window(i, oh, stride), _window(j, ow, stride)]
            for i in range(size)
            for j in range(size)
        ]
        stacked = xp.stack(parts, axis=0)  # (size*size, N, C, OH, OW)
        return xp.max(stacked, axis=0), xp.argmax(stacked, axis=0)

    def maxpool2d_backward(
        self, dy: Array, idx: Array, x_shape: tuple[int, ...], size: int, stride: int
    ) -> Array:
        xp = self.xp
        n, c, oh, ow = dy.shape
        dx = xp.zeros(tuple(x_shape), dtype=dy.dtype)
        zero = xp.zeros_like(dy)
        for i in range(size):
            for j in range(size):
                sl = (slice(None), slice(None), _window(i, oh, stride), _window(j, ow, stride))
                dx[sl] = dx[sl] + xp.where(idx == i * size + j, dy, zero)
        return dx

    # -- dropout ----------------------------------------------------------------------------
    def _fmix32(self, h: Array) -> Array:
        h = h ^ (h >> 16)
        h = h * FMIX_M1
        h = h ^ (h >> 13)
        h = h * FMIX_M2
        return h ^ (h >> 16)

    def _sample_keys(self, base: int, sample_ids: Array) -> Array:
        """uint32 key per sample: ``mix(mix(base, id_lo), id_hi)``."""
        xp = self.xp
        ids = xp.astype(xp.asarray(sample_ids), xp.int64)
        lo = xp.astype(ids & MASK32, xp.uint32)
        hi = xp.astype((ids >> 32) & MASK32, xp.uint32)
        s = self._fmix32(self._fmix32(lo + GOLDEN) ^ base)
        return self._fmix32(self._fmix32(hi + GOLDEN) ^ s)

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
        """(N, ...) mask of 0 and 1/(1-p); sample n's part depends only on its id (see top)."""
        xp = self.xp
        n = shape[0]
        f = 1
        for s in shape[1:]:
            f *= s
        if sample_ids.shape[0] != n:
            raise ValueError(f"{sample_ids.shape[0]} sample ids for a batch of {n}")
        keys = self._sample_keys(dropout_base_key(seed, step, salt), sample_ids)
        elems = self._fmix32(xp.arange(f, dtype=xp.uint32) + GOLDEN)
        h = self._fmix32(xp.reshape(keys, (n, 1)) ^ xp.reshape(elems, (1, f)))
        keep = xp.astype(h >= dropout_threshold(p), dtype)
        return xp.reshape(keep * (1.0 / (1.0 - p)), tuple(shape))


class NumpyConvKernels:
    """NumPy-API versions (NumPy and CuPy): stride tricks, in-place adds, ``out=``.

    Meant to sit before ``Kernels`` in ``NumpyKernels``' bases.
    """

    xp: Any

    def im2col(
        self,
        x: Array,
        kh: int,
        kw: int,
        stride: int,
        padding: int,
        out: Array | None = None,
        out_hw: tuple[int, int] | None = None,
    ) -> Array:
        xp = self.xp
        n, c, h, w = x.shape
        oh, ow = conv_out_hw(x.shape, kh, kw, stride, padding, out_hw)
        if padding:
            xpad = xp.zeros((n, c, h + 2 * padding, w + 2 * padding), dtype=x.dtype)
            xpad[:, :, padding : padding + h, padding : padding + w] = x
        else:
            xpad = x
        sn, sc, sh, sw = xpad.strides
        view = xp.lib.stride_tricks.as_strided(
            xpad,
            shape=(c, kh, kw, n, oh, ow),
            strides=(sc, sh, sw, sn, sh * stride, sw * stride),
        )
        if out is None:
            out = xp.empty((c * kh * kw, n * oh * ow), dtype=x.dtype)
        out.reshape(c, kh, kw, n, oh, ow)[...] = view
        return out

    def col2im(
        self,
        cols: Array,
        x_shape: tuple[int, ...],
        kh: int,
        kw: int,
        stride: int,
        padding: int,
        out_hw: tuple[int, int] | None = None,
    ) -> Array:
        xp = self.xp
        n, c, h, w = x_shape
        oh, ow = conv_out_hw(x_shape, kh, kw, stride, padding, out_hw)
        d = cols.reshape(c, kh, kw, n, oh, ow)
        # accumulate in cols' (C, N, ...) order (contiguous reads), transpose once at the end
        acc = xp.zeros((c, n, h + 2 * padding, w + 2 * padding), dtype=cols.dtype)
        for i in range(kh):
            for j in range(kw):
                acc[:, :, _window(i, oh, stride), _window(j, ow, stride)] += d[:, i, j]
        dx = xp.empty((n, c, h, w), dtype=cols.dtype)
        dx[...] = acc[:, :, padding : padding + h, padding : padding + w].transpose(1, 0, 2, 3)
        return dx

    def conv_output(
        self, yc: Array, b: Array, shape: tuple[int, ...], act: str = "identity"
    ) -> Array:
        xp = self.xp
        n, c, oh, ow = shape
        y = xp.empty(shape, dtype=yc.dtype)
        xp.add(yc.reshape(c, n, oh, ow).transpose(1, 0, 2, 3), b.reshape(1, c, 1, 1), out=y)
        if act == "relu":
            return xp.maximum(y, 0, out=y)
        if act == "tanh":
            return xp.tanh(y, out=y)
        return self.activation(y, act)

    def conv_output_grad(
        self, dy: Array, out: Array | None = None, y: Array | None = None, act: str = "identity"
    ) -> tuple[Array, Array]:
        xp = self.xp
        if act != "identity":
            dy = self.activation_grad(dy, y, act)
        n, c, oh, ow = dy.shape
        if out is None:
            out = xp.empty((c, n * oh * ow), dtype=dy.dtype)
        out.reshape(c, n, oh * ow)[...] = dy.reshape(n, c, oh * ow).transpose(1, 0, 2)
        return out, out.sum(axis=1)

    def maxpool2d_forward(self, x: Array, size: int, stride: int) -> tuple[Array, Array]:
        xp = self.xp
        n, c, h, w = x.shape
        oh, ow = (h - size) // stride + 1, (w - size) // stride + 1
        if stride == size:
            # non-overlapping windows: elementwise max/compare over the size*size strided
            # views (an argmax over a trailing axis of 4 is ~10x slower in NumPy)
            views = [
                x[:, :, _window(i, oh, stride), _window(j, ow, stride)]
                for i in range(size)
                for j in range(size)
            ]
            y = views[0].copy()
            for v in views[1:]:
                xp.maximum(y, v, out=y)
            itype = xp.uint8 if size <= 16 else xp.int32
            idx = xp.zeros(y.shape, dtype=itype)
            found = views[0] == y
            for k in range(1, size * size):  # the first maximum wins ties
                hit = views[k] == y
                hit &= ~found
                found |= hit
                idx += hit.astype(itype) * itype(k)  # (masked writes are ~10x slower)
            nan = y != y  # a NaN window: no view equals y; point at its first NaN
            if nan.any():
                for k in range(size * size - 1, -1, -1):
                    idx[nan & (views[k] != views[k])] = k
            return y, idx
        sn, sc, sh, sw = x.strides
        view = xp.lib.stride_tricks.as_strided(
            x,
            shape=(n, c, oh, ow, size, size),
            strides=(sn, sc, sh * stride, sw * stride, sh, sw),
        )
        win = view.reshape(n, c, oh, ow, size * size)
        idx = win.argmax(axis=-1)
        y = xp.take_along_axis(win, idx[..., None], axis=-1)[..., 0]
        return y, idx

    def maxpool2d_backward(
        self, dy: Array, idx: Array, x_shape: tuple[int, ...], size: int, stride: int
    ) -> Array:
        xp = self.xp
        n, c, oh, ow = dy.shape
        dx = xp.zeros(tuple(x_shape), dtype=dy.dtype)
        for i in range(size):
            for j in range(size):
                view = dx[:, :, _window(i, oh, stride), _window(j, ow, stride)]
                if stride >= size:  # windows do not overlap: write, do not add
                    xp.multiply(dy, idx == i * size + j, out=view)
                else:
                    view += xp.where(idx == i * size + j, dy, 0)
        return dx
