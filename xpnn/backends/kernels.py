"""The ``Kernels`` protocol: every hot operation of the network, each with its array-API version,
the reference that a backend's class overrides where it is faster, with the same parameters.
No kernel synchronises or copies to the host. Layouts are the same on every backend:

* ``im2col``: (N, C, H, W) -> (C*kh*kw, N*OH*OW), rows in ``W.reshape(C_out, -1)``'s order, so a
  convolution is one GEMM; ``col2im`` is its adjoint and may use ``cols`` as scratch. ``out_hw``
  limits both to the outputs a floor-mode max-pool reads (``Conv2D.limit_output``).
* ``maxpool2d_forward``'s ``idx``: the argmax's offset in the window (first maximum, first NaN).
* ``dropout_mask`` hashes (seed, salt, step, sample id, element) in uint32 arithmetic: every
  backend, rank and batch split draws the bit-identical mask for a sample.
* Optimizer updates work in place on flat buffers and zero subnormal state (``flush_subnormal``).
"""

import math
from types import ModuleType
from typing import Any

from xpnn.backends.common import (
    ACTIVATIONS,
    FMIX_M1,
    FMIX_M2,
    GOLDEN,
    MASK32,
    OutHW,
    conv_out_hw,
    dropout_threshold,
    dtype_is,
    mask_rows,
    step_key,
    taps,
)

Array = Any
__all__ = ["ACTIVATIONS", "Kernels", "dtype_is"]


GELU_C = math.sqrt(2.0 / math.pi)  # the tanh GELU's constants (Hendrycks & Gimpel, 2016)
GELU_A = 0.044715


def _written(value: Array, out: Array | None) -> Array:
    if out is None:
        return value
    out[...] = value
    return out


class Kernels:
    """The protocol and its generic implementation: array-API operations only."""

    CHUNK: int | None = None
    # The dropout hash's integers: uint32 wraps by itself; a library without uint32 arithmetic
    # (PyTorch) hashes in int64, masked to the low 32 bits after every step that can carry.
    HASH_DTYPE = "uint32"

    def __init__(self, xp: ModuleType) -> None:
        self.xp = xp

    def matmul_into(self, a: Array, b: Array, out: Array) -> Array:
        """``out[...] = a @ b``; gradients land in views of the flat gradient buffer."""
        out[...] = self.xp.matmul(a, b)
        return out

    def activation(self, z: Array, act: str) -> Array:
        xp = self.xp
        if act == "relu":
            # NaN stays NaN (as np.maximum keeps it): a diverged run must show in the loss
            return xp.where(z <= 0, xp.zeros_like(z), z)
        if act == "sigmoid":
            # exp(-|z|) never overflows; the two branches are the same function.
            e = xp.exp(-xp.abs(z))
            return xp.where(z >= 0, 1 / (1 + e), e / (1 + e))
        if act == "tanh":
            return xp.tanh(z)
        if act == "identity":
            return z
        raise ValueError(f"unknown activation {act!r}")

    def activation_grad(self, dy: Array, y: Array, act: str) -> Array:
        """dL/dz from dL/dy and the activation's *output* y (all four are cheap that way)."""
        xp = self.xp
        if act == "relu":
            return xp.where(y > 0, dy, xp.zeros_like(dy))
        if act == "sigmoid":
            return dy * y * (1 - y)
        if act == "tanh":
            return dy * (1 - y * y)
        if act == "identity":
            return dy
        raise ValueError(f"unknown activation {act!r}")

    def bias_act(self, z: Array, b: Array, act: str) -> Array:
        """``act(z + b)``; may overwrite ``z`` (fused backends do it in place)."""
        return self.activation(z + b, act)

    def bias_act_backward(self, dy: Array, y: Array, act: str) -> tuple[Array, Array]:
        """(dL/dz, dL/db) for ``y = act(z + b)``; may overwrite ``dy``."""
        dz = self.activation_grad(dy, y, act)
        return dz, self.xp.sum(dz, axis=0)

    def one_hot(self, labels: Array, num_classes: int, dtype: Any) -> Array:
        xp = self.xp
        classes = xp.arange(num_classes, dtype=labels.dtype)
        return xp.astype(xp.reshape(labels, (-1, 1)) == classes, dtype)

    def pick(self, logits: Array, labels: Array) -> Array:
        xp = self.xp
        idx = xp.reshape(xp.astype(labels, xp.int64), (-1, 1))
        return xp.reshape(xp.take_along_axis(logits, idx, axis=1), (-1,))

    def check_labels(self, logits: Array, labels: Array) -> None:
        """One integer class index per row of ``logits`` ((N, 1) would broadcast): shape and dtype
        only, no pass over the values, no device sync (host kernels add it)."""
        shape = getattr(labels, "shape", None)
        dtype = getattr(labels, "dtype", None)
        if shape is None or dtype is None:
            raise ValueError(f"labels must be an integer array, got {type(labels).__name__}")
        n = logits.shape[0]
        if len(shape) != 1 or shape[0] != n:
            raise ValueError(
                f"labels must be a 1-D integer array of length {n} (one class index per row of "
                f"logits of shape {tuple(logits.shape)}), got shape {tuple(shape)}"
            )
        if not dtype_is(dtype, "integral"):
            raise ValueError(f"labels must be class indices of an integer dtype, got {dtype}")

    def softmax_cross_entropy(
        self, logits: Array, labels: Array, scale: float
    ) -> tuple[Array, Array]:
        """(sum of per-sample losses, gradient of ``scale * sum`` w.r.t. the logits): a sum, so
        ranks add their parts exactly; ``scale`` is 1 / global batch."""
        self.check_labels(logits, labels)
        xp = self.xp
        m = xp.max(logits, axis=1, keepdims=True)
        e = xp.exp(logits - m)
        s = xp.sum(e, axis=1, keepdims=True)
        onehot = self.one_hot(labels, logits.shape[1], logits.dtype)
        # indexed, not sum(logits * onehot): a -inf logit of another class times 0 is NaN
        picked = self.pick(logits, labels)
        loss = xp.sum(xp.log(s[:, 0]) + m[:, 0] - picked)
        return loss, (e / s - onehot) * scale

    def sigmoid_binary_cross_entropy(
        self, logits: Array, labels: Array, scale: float
    ) -> tuple[Array, Array]:
        """The seeds' cost: independent sigmoids against one-hot targets, summed over classes."""
        self.check_labels(logits, labels)
        xp = self.xp
        t = self.one_hot(labels, logits.shape[1], logits.dtype)
        # log(1 + exp(-|z|)) + max(z, 0) - z t  is  -t log s(z) - (1-t) log(1-s(z)), stably.
        loss = xp.sum(
            xp.log(1 + xp.exp(-xp.abs(logits))) + self.activation(logits, "relu") - logits * t
        )
        return loss, (self.activation(logits, "sigmoid") - t) * scale

    def count_correct(self, logits: Array, labels: Array) -> Array:
        """Samples whose top logit is the label; an (N, T, K) sequence adds its fraction right."""
        xp = self.xp
        if logits.ndim > 2:
            positions = math.prod(labels.shape[1:])
            hits = xp.astype(xp.argmax(logits, axis=-1) == labels, xp.float64)
            return xp.sum(hits) / positions
        Kernels.check_labels(self, logits, labels)  # no range check: it indexes nothing
        # float64, as for sequences: a step adds it to float sums (exact below 2**53)
        return xp.sum(xp.astype(xp.argmax(logits, axis=1) == labels, xp.float64))

    def embedding_grad(self, ids: Array, dy: Array, out: Array) -> Array:
        """``out[ids[i]] += dy[i]`` from zero as a one-hot product: the array API has no scatter."""
        onehot = self.one_hot(ids, out.shape[0], dy.dtype)
        return self.matmul_into(self.xp.permute_dims(onehot, (1, 0)), dy, out)

    def gelu(self, x: Array) -> tuple[Array, Array]:
        """The tanh GELU: ``(y, t)``, ``t`` kept for the backward."""
        t = self.xp.tanh(GELU_C * (x + GELU_A * x * x * x))
        return 0.5 * x * (1.0 + t), t

    def gelu_backward(self, dy: Array, x: Array, t: Array) -> Array:
        """dL/dx of ``gelu`` from dL/dy, its input ``x`` and its ``t``."""
        inner = GELU_C * (1.0 + 3.0 * GELU_A * x * x)
        return dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * inner)

    def bias_gelu(self, z: Array, b: Array) -> tuple[Array, Array, Array]:
        """``(x, y, t)``: ``x = z + b`` (may be ``z``), ``(y, t) = gelu(x)``: an epilogue; a
        backend may keep no ``t`` (None) and compute it again in ``bias_gelu_backward``."""
        x = self.bias_act(z, b, "identity")
        return (x, *self.gelu(x))

    def bias_gelu_backward(self, dy: Array, x: Array, t: Array) -> tuple[Array, Array]:
        """(dL/dx, dL/db) of ``bias_gelu`` from dL/dy; may overwrite ``dy``."""
        return self.bias_act_backward(self.gelu_backward(dy, x, t), x, "identity")

    def layer_norm(self, x: Array, gamma: Array, beta: Array, eps: float) -> tuple[Array, ...]:
        """LayerNorm of the last axis: ``(gamma xhat + beta, xhat, inv_std)``, the last two kept."""
        xp = self.xp
        centred = x - xp.mean(x, axis=-1, keepdims=True)
        inv_std = 1.0 / xp.sqrt(xp.mean(centred * centred, axis=-1, keepdims=True) + eps)
        xhat = centred * inv_std
        return xhat * gamma + beta, xhat, inv_std

    def layer_norm_backward(
        self, dy: Array, xhat: Array, inv_std: Array, gamma: Array, need_dx: bool
    ) -> tuple[Array | None, Array, Array]:
        """``(dx or None, dgamma, dbeta)`` of ``layer_norm`` from dL/dy."""
        xp = self.xp
        lead = tuple(range(dy.ndim - 1))  # every axis but the features
        dgamma, dbeta = xp.sum(dy * xhat, axis=lead), xp.sum(dy, axis=lead)
        if not need_dx:
            return None, dgamma, dbeta
        g = dy * gamma
        mean_g = xp.mean(g, axis=-1, keepdims=True)
        mean_gx = xp.mean(g * xhat, axis=-1, keepdims=True)
        return (g - mean_g - xhat * mean_gx) * inv_std, dgamma, dbeta

    def causal_softmax(self, scores: Array) -> Array:
        """Softmax of (..., T, T) scores over the keys ``j <= i`` of query ``i``; the rest 0."""
        xp = self.xp
        t = scores.shape[-1]
        pos = xp.arange(t)
        seen = xp.reshape(pos, (t, 1)) >= xp.reshape(pos, (1, t))
        masked = xp.where(seen, scores, xp.asarray(-xp.inf, dtype=scores.dtype))
        e = xp.exp(masked - xp.max(masked, axis=-1, keepdims=True))
        return e / xp.sum(e, axis=-1, keepdims=True)

    def causal_softmax_backward(self, dp: Array, p: Array) -> Array:
        """dL/dscores from dL/dp and ``causal_softmax``'s output ``p`` (0 where masked)."""
        return p * (dp - self.xp.sum(dp * p, axis=-1, keepdims=True))

    def causal_attention(
        self, q: Array, k: Array, v: Array, scale: float, out: Array | None = None
    ) -> tuple[Array, Array]:
        """(B, heads, T, head dim) attention: ``(p v, p)``, ``p = causal_softmax(q k^T scale)``;
        ``p v`` into ``out`` when given (a view of the caller's layout spares it a copy)."""
        xp = self.xp
        p = self.causal_softmax(xp.matmul(q, xp.permute_dims(k, (0, 1, 3, 2))) * scale)
        return _written(xp.matmul(p, v), out), p

    def causal_attention_backward(
        self,
        dout: Array,
        q: Array,
        k: Array,
        v: Array,
        p: Array,
        scale: float,
        out: tuple[Array, Array, Array] | None = None,
    ) -> tuple[Array, Array, Array]:
        """``(dq, dk, dv)`` of ``causal_attention`` from dL/dout, into ``out``'s when given."""
        xp = self.xp
        dv = xp.matmul(xp.permute_dims(p, (0, 1, 3, 2)), dout)
        dp = xp.matmul(dout, xp.permute_dims(v, (0, 1, 3, 2)))
        ds = self.causal_softmax_backward(dp, p) * scale
        grads = (xp.matmul(ds, k), xp.matmul(xp.permute_dims(ds, (0, 1, 3, 2)), q), dv)
        if out is None:
            return grads
        return tuple(_written(g, o) for g, o in zip(grads, out, strict=True))

    def sum_rows(self, rows: tuple[Array, ...], out: Array) -> Array:
        """``out = rows[0] + rows[1] + ...`` in that order: node-shared ranks' gradient rows."""
        return _written(sum(rows[1:], rows[0]), out)

    def sum_squares(self, x: Array) -> Array:
        """A gradient's squared norm, a float64 scalar left on the device: the caller adds
        several, then reads one number."""
        return self.xp.sum(x * x, dtype=self.xp.float64)

    def flush_subnormal(self, x: Array) -> None:
        """Zero the subnormal values of ``x``, keeping NaN and infinity: optimizer state of a dead
        ReLU unit decays into them, each a slow path on x86 (docs/decisions/subnormal-flush.md)."""
        xp = self.xp
        x[xp.abs(x) < xp.finfo(x.dtype).smallest_normal] = 0

    def _pieces(self, n: int) -> list[slice]:
        """One update's passes: ``CHUNK`` values each (None: the whole buffer), kept in cache."""
        step = self.CHUNK or max(n, 1)
        return [slice(lo, min(n, lo + step)) for lo in range(0, n, step)]

    def sgd_update(self, p: Array, g: Array, lr: float) -> None:
        for s in self._pieces(p.shape[0]):
            pi = p[s]
            pi -= lr * g[s]

    def momentum_update(self, p: Array, g: Array, v: Array, lr: float, mu: float) -> None:
        """Heavy-ball momentum: v = mu v + g; p -= lr v (PyTorch's convention)."""
        for s in self._pieces(p.shape[0]):
            pi, vi = p[s], v[s]
            vi *= mu
            vi += g[s]
            self.flush_subnormal(vi)
            pi -= lr * vi

    def adam_update(
        self,
        p: Array,
        g: Array,
        m: Array,
        v: Array,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        step: int,
        decay: float = 1.0,
    ) -> None:
        """Adam (Kingma & Ba) with bias correction folded into the step size; ``decay``: the
        factor ``1 - lr * weight_decay`` of AdamW (Loshchilov & Hutter), on ``p`` first."""
        c1, c2 = 1 - beta1**step, 1 - beta2**step
        self.adam_step(p, g, m, v, lr / c1, beta1, beta2, eps, c2, decay)

    def adam_step(
        self,
        p: Array,
        g: Array,
        m: Array,
        v: Array,
        lr_c1: Any,
        beta1: float,
        beta2: float,
        eps: float,
        c2: Any,
        decay: Any = 1.0,
    ) -> None:
        """``adam_update`` given ``lr / (1 - beta1**step)`` and ``1 - beta2**step``, numbers or
        0-d arrays that a replayed step reads (``StepScalars``)."""
        for s in self._pieces(p.shape[0]):
            pi, gi, mi, vi = p[s], g[s], m[s], v[s]
            if decay != 1.0:
                pi *= decay
            mi *= beta1
            mi += (1 - beta1) * gi
            self.flush_subnormal(mi)
            vi *= beta2
            vi += (1 - beta2) * (gi * gi)
            self.flush_subnormal(vi)
            pi -= lr_c1 * (mi / (self.xp.sqrt(vi / c2) + eps))

    def _padded(self, x: Array, padding: int) -> Array:
        if not padding:
            return x
        n, c, h, w = x.shape
        xpad = self.xp.zeros((n, c, h + 2 * padding, w + 2 * padding), dtype=x.dtype)
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
        out_hw: OutHW = None,
    ) -> Array:
        """(N, C, H, W) -> (C*kh*kw, N*OH*OW), written into ``out`` when given."""
        xp = self.xp
        n, c, h, w = x.shape
        oh, ow = conv_out_hw(x.shape, kh, kw, stride, padding, out_hw)
        xpad = self._padded(x, padding)
        parts = [xpad[:, :, r, q] for r, q in taps(kh, kw, oh, ow, stride)]
        stacked = xp.stack(parts, axis=2)  # (N, C, kh*kw, OH, OW)
        cols = xp.reshape(xp.permute_dims(stacked, (1, 2, 0, 3, 4)), (c * kh * kw, n * oh * ow))
        return _written(cols, out)

    def col2im(
        self,
        cols: Array,
        x_shape: tuple[int, ...],
        kh: int,
        kw: int,
        stride: int,
        padding: int,
        out_hw: OutHW = None,
    ) -> Array:
        """The adjoint of ``im2col``: (C*kh*kw, N*OH*OW) -> (N, C, H, W), overlaps summed."""
        xp = self.xp
        n, c, h, w = x_shape
        oh, ow = conv_out_hw(x_shape, kh, kw, stride, padding, out_hw)
        d = xp.permute_dims(xp.reshape(cols, (c, kh * kw, n, oh, ow)), (2, 0, 1, 3, 4))
        dx = xp.zeros((n, c, h + 2 * padding, w + 2 * padding), dtype=cols.dtype)
        for k, (r, q) in enumerate(taps(kh, kw, oh, ow, stride)):
            dx[:, :, r, q] = dx[:, :, r, q] + d[:, :, k, :, :]
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
        """(dL/d(GEMM result) as (C_out, N*P), into ``out``; dL/db); ``y``: the forward output."""
        xp = self.xp
        if act != "identity":
            dy = self.activation_grad(dy, y, act)
        n, c, oh, ow = dy.shape
        dyc = xp.reshape(
            xp.permute_dims(xp.reshape(dy, (n, c, oh * ow)), (1, 0, 2)), (c, n * oh * ow)
        )
        dyc = _written(dyc, out)
        return dyc, xp.sum(dyc, axis=1)

    def conv_direct_pays(self, c_in: int, kh: int, kw: int, stride: int) -> bool:
        """Whether ``conv_direct`` beats im2col and one GEMM for this geometry: never here."""
        return False

    def conv_direct(
        self,
        x: Array,
        w: Array,
        b: Array,
        stride: int,
        padding: int,
        out_hw: tuple[int, int],
        act: str,
    ) -> Array:
        """``act(conv(x, w) + b)`` -> (N, C_out, *out_hw); no columns kept: the backward reads x."""
        xp = self.xp
        c_out, _, kh, kw = w.shape
        cols = self.im2col(x, kh, kw, stride, padding, out_hw=out_hw)
        yc = xp.matmul(xp.reshape(w, (c_out, -1)), cols)
        return self.conv_output(yc, b, (x.shape[0], c_out, *out_hw), act)

    def conv_direct_backward(
        self,
        dy: Array,
        x: Array,
        y: Array | None,
        w: Array,
        stride: int,
        padding: int,
        act: str,
        dw: Array,
        need_dx: bool,
    ) -> tuple[Array, Array | None]:
        """``(dL/db, dL/dx or None)`` of ``conv_direct`` from dL/dy, ``x``, ``y``; dL/dW into dw."""
        xp = self.xp
        c_out, _, kh, kw = w.shape
        out_hw = tuple(dy.shape[2:])
        dyc, db = self.conv_output_grad(dy, None, y, act)
        cols = self.im2col(x, kh, kw, stride, padding, out_hw=out_hw)
        w2 = xp.reshape(w, (c_out, -1))
        dw[...] = xp.reshape(xp.matmul(dyc, xp.permute_dims(cols, (1, 0))), tuple(w.shape))
        if not need_dx:
            return db, None
        dcols = xp.matmul(xp.permute_dims(w2, (1, 0)), dyc)
        return db, self.col2im(dcols, tuple(x.shape), kh, kw, stride, padding, out_hw)

    def maxpool2d_forward(self, x: Array, size: int, stride: int) -> tuple[Array, Array]:
        xp = self.xp
        oh, ow = conv_out_hw(x.shape, size, size, stride, 0)
        # (N, C, OH, OW, size*size): a reduction along the contiguous last axis (PyTorch's
        # argmax over a leading axis of 4 took 3.4x as long)
        stacked = xp.stack([x[:, :, r, q] for r, q in taps(size, size, oh, ow, stride)], axis=-1)
        return xp.max(stacked, axis=-1), xp.argmax(stacked, axis=-1)

    def maxpool2d_backward(
        self, dy: Array, idx: Array, x_shape: tuple[int, ...], size: int, stride: int
    ) -> Array:
        xp = self.xp
        oh, ow = dy.shape[2:]
        dx = xp.zeros(tuple(x_shape), dtype=dy.dtype)
        zero = xp.zeros_like(dy)
        for k, (r, q) in enumerate(taps(size, size, oh, ow, stride)):
            routed = xp.where(idx == k, dy, zero)
            # windows that do not overlap: each element is written once, not added to
            dx[:, :, r, q] = routed if stride >= size else dx[:, :, r, q] + routed
        return dx

    def conv_relu_pool_pays(self) -> bool:
        """Whether ``conv_relu_pool`` beats the ReLU pass and the pool's apart: never here."""
        return False

    def conv_relu_pool(self, yc: Array, b: Array, shape: tuple[int, ...]) -> tuple[Array, Array]:
        """The ReLU ``conv_output`` 2x2-pooled: (pooled, idx); ``shape``'s OH and OW even."""
        return self.maxpool2d_forward(self.conv_output(yc, b, shape, "relu"), 2, 2)

    def conv_relu_pool_grad(
        self, dy: Array, y: Array, idx: Array, shape: tuple[int, ...], out: Array | None = None
    ) -> tuple[Array, Array]:
        """``conv_output_grad``'s pair for ``conv_relu_pool`` from the pooled dy, ``y``, ``idx``."""
        dy = self.activation_grad(dy, y, "relu")
        return self.conv_output_grad(self.maxpool2d_backward(dy, idx, shape, 2, 2), out)

    def conv_direct_relu_pool(
        self, x: Array, w: Array, b: Array, stride: int, padding: int, out_hw: tuple[int, int]
    ) -> tuple[Array, Array]:
        """``conv_relu_pool`` of ``conv_direct``'s ReLU output (``out_hw`` even): (pooled, idx)."""
        y = self.conv_direct(x, w, b, stride, padding, out_hw, "relu")
        return self.maxpool2d_forward(y, 2, 2)

    def conv_direct_relu_pool_backward(
        self,
        dy: Array,
        x: Array,
        y: Array,
        idx: Array,
        w: Array,
        stride: int,
        padding: int,
        dw: Array,
        need_dx: bool,
    ) -> tuple[Array, Array | None]:
        """``conv_direct_backward``'s pair for ``conv_direct_relu_pool`` from pooled dy, y, idx."""
        shape = (dy.shape[0], dy.shape[1], 2 * dy.shape[2], 2 * dy.shape[3])
        dz = self.maxpool2d_backward(self.activation_grad(dy, y, "relu"), idx, shape, 2, 2)
        return self.conv_direct_backward(dz, x, None, w, stride, padding, "identity", dw, need_dx)

    def _low32(self, h: Array) -> Array:
        return h if self.HASH_DTYPE == "uint32" else h & MASK32

    def _fmix32(self, h: Array) -> Array:
        h = self._low32(h)
        h = h ^ (h >> 16)
        h = self._low32(h * FMIX_M1)
        h = h ^ (h >> 13)
        h = self._low32(h * FMIX_M2)
        return h ^ (h >> 16)

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
        xp, hashed = self.xp, getattr(self.xp, self.HASH_DTYPE)
        n, f = mask_rows(shape, sample_ids)
        ids = xp.astype(xp.asarray(sample_ids), xp.int64)  # each 32-bit half mixed in turn
        lo, hi = xp.astype(ids & MASK32, hashed), xp.astype((ids >> 32) & MASK32, hashed)
        keys = self._fmix32(self._fmix32(lo + GOLDEN) ^ step_key(seed, step, salt))
        keys = self._fmix32(self._fmix32(hi + GOLDEN) ^ keys)
        elems = self._fmix32(xp.arange(f, dtype=hashed) + GOLDEN)
        h = self._fmix32(xp.reshape(keys, (n, 1)) ^ xp.reshape(elems, (1, f)))
        keep = xp.astype(h >= dropout_threshold(p), dtype)
        return xp.reshape(keep * (1.0 / (1.0 - p)), tuple(shape))
