"""The kernel table: the hot operations of the network, each with a generic ``xp`` version.

``Kernels`` uses only array-API operations, so it runs on NumPy, CuPy and array-api-strict
alike; that is the proof that the math is portable. Backends subclass it and override only the
kernels they make faster (fused loops in Numba, elementwise kernels in CuPy). Every kernel takes
and returns arrays of the backend; none of them synchronises or copies to the host.
"""

from __future__ import annotations

from functools import cache
from types import ModuleType
from typing import Any

from xpnn.backends.conv_kernels import ConvKernels, NumpyConvKernels

Array = Any
Grad = Any  # an Array, or a tuple of Arrays whose sum is the gradient
ACTIVATIONS = ("relu", "sigmoid", "tanh", "identity")


_KIND_LETTERS = {"integral": "iu", "real floating": "f"}
_KIND_NAMES = {"integral": "int", "real floating": "float"}


def dtype_is(dtype: Any, kind: str) -> bool:
    """Whether ``dtype`` is ``"integral"`` or ``"real floating"`` (the array API's names):
    by NumPy's and CuPy's kind letter, else by an array API namespace's dtype name."""
    letter = getattr(dtype, "kind", None)
    if letter is not None:
        return letter in _KIND_LETTERS[kind]
    return _KIND_NAMES[kind] in str(dtype)


def check_labels(logits: Array, labels: Array) -> None:
    """Labels must be a 1-D integer array with one class index per row of ``logits``.

    Metadata only (shape and dtype): no pass over the values, no device sync. Without it a
    column of labels (N, 1) broadcasts into a wrong loss and accuracy, and float labels fail
    deep inside a kernel.
    """
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


def check_label_values(labels: Any, num_classes: int) -> None:
    """Every label is a class index in [0, num_classes). A pass over the labels (N values),
    so only for host arrays, where a bad index reads or writes outside the logits."""
    if labels.size == 0:
        return
    lo, hi = int(labels.min()), int(labels.max())
    if lo < 0 or hi >= num_classes:
        import numpy as np

        bad = np.unique(labels[(labels < 0) | (labels >= num_classes)])
        shown = ", ".join(str(int(v)) for v in bad[:10]) + (", ..." if bad.size > 10 else "")
        raise ValueError(
            f"labels out of range: {shown} ({bad.size} distinct bad value(s)); class "
            f"indices must be in [0, {num_classes}) for {num_classes} classes"
        )


class Kernels(ConvKernels):
    """Generic, array-API-only kernels."""

    def __init__(self, xp: ModuleType) -> None:
        self.xp = xp

    # -- dense layer pieces -------------------------------------------------------------
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
        """(dL/dz, dL/db) for ``y = act(z + b)``."""
        dz = self.activation_grad(dy, y, act)
        return dz, self.xp.sum(dz, axis=0)

    # -- losses -------------------------------------------------------------------------
    def one_hot(self, labels: Array, num_classes: int, dtype: Any) -> Array:
        xp = self.xp
        classes = xp.arange(num_classes, dtype=labels.dtype)
        return xp.astype(xp.reshape(labels, (-1, 1)) == classes, dtype)

    def softmax_cross_entropy(
        self, logits: Array, labels: Array, scale: float
    ) -> tuple[Array, Array]:
        """(sum of per-sample losses, gradient of ``scale * sum`` w.r.t. the logits).

        The sum (not the mean) is returned so that ranks can add their parts exactly; ``scale``
        is 1 / global batch so that every rank's gradient is its share of the global mean.
        """
        self.check_labels(logits, labels)
        xp = self.xp
        m = xp.max(logits, axis=1, keepdims=True)
        e = xp.exp(logits - m)
        s = xp.sum(e, axis=1, keepdims=True)
        onehot = self.one_hot(labels, logits.shape[1], logits.dtype)
        # indexed, not sum(logits * onehot): a -inf logit of another class times 0 is NaN
        picked = self.pick(logits, labels)
        loss = xp.sum(xp.log(s[:, 0]) + m[:, 0] - picked)
        grad = (e / s - onehot) * scale
        return loss, grad

    def sigmoid_binary_cross_entropy(
        self, logits: Array, labels: Array, scale: float
    ) -> tuple[Array, Array]:
        """The seeds' cost: independent sigmoids against one-hot targets, summed over classes."""
        self.check_labels(logits, labels)
        xp = self.xp
        t = self.one_hot(labels, logits.shape[1], logits.dtype)
        # log(1 + exp(-|z|)) + max(z, 0) - z t  is  -t log s(z) - (1-t) log(1-s(z)), stably.
        relu = xp.where(logits <= 0, xp.zeros_like(logits), logits)
        loss = xp.sum(xp.log(1 + xp.exp(-xp.abs(logits))) + relu - logits * t)
        grad = (self.activation(logits, "sigmoid") - t) * scale
        return loss, grad

    def pick(self, logits: Array, labels: Array) -> Array:
        """``logits[i, labels[i]]`` for every row i."""
        xp = self.xp
        idx = xp.reshape(xp.astype(labels, xp.int64), (-1, 1))
        return xp.reshape(xp.take_along_axis(logits, idx, axis=1), (-1,))

    def check_labels(self, logits: Array, labels: Array) -> None:
        """Shape and dtype only (``check_labels``): no pass over the values, no device sync.
        Every kernel that takes labels calls it once; host kernels add the values' range."""
        check_labels(logits, labels)

    def count_correct(self, logits: Array, labels: Array) -> Array:
        xp = self.xp
        check_labels(logits, labels)  # the shape (a column broadcasts); it indexes nothing
        return xp.sum(xp.astype(xp.argmax(logits, axis=1) == labels, xp.int64))

    # -- optimizer updates, in place on flat buffers ------------------------------------
    # ``g`` is a gradient buffer, or a tuple of them whose sum is the gradient: ranks that
    # share memory each write their own, and a fused update sums them as it reads them
    # instead of in a pass over memory of its own.
    def summed(self, g: Grad) -> Array:
        """The gradient that ``g`` stands for (a new array when it is a tuple of several)."""
        if not isinstance(g, tuple):
            return g
        total = g[0]
        for part in g[1:]:
            total = total + part
        return total

    def sgd_update(self, p: Array, g: Grad, lr: float) -> None:
        p -= lr * self.summed(g)

    def flush_subnormal(self, x: Array) -> None:
        """Set the values of ``x`` that are subnormal (nonzero, below the dtype's smallest
        normal number: 1.2e-38 in float32) to zero. NaN and infinity are kept.

        For the optimizers' state. A moment whose gradient stays 0 (the weights of a dead ReLU
        unit) decays by its beta every step: Adam's first moment falls below the smallest
        normal number some 650 steps after its last gradient, and spends another ~150 steps
        there on its way to 0. On x86 CPUs, and many others, an operation on a subnormal value
        takes a slow microcode path: the 2nd and 3rd epochs of the MLP 784-1024-1024-10 on
        Fashion-MNIST took 20 % and 50 % longer than the first on one rank (README, *Subnormal
        optimizer state*). Such a moment moves no weight, so it is zero from there on, as a
        flush-to-zero CPU mode would make it. Adam also divides ``m`` before it multiplies by
        the step size: that product was subnormal for ``m`` up to 1e-35."""
        xp = self.xp
        x[xp.abs(x) < xp.finfo(x.dtype).smallest_normal] = 0

    def momentum_update(self, p: Array, g: Grad, v: Array, lr: float, mu: float) -> None:
        """Heavy-ball momentum: v = mu v + g; p -= lr v (PyTorch's convention)."""
        g = self.summed(g)
        v *= mu
        v += g
        self.flush_subnormal(v)
        p -= lr * v

    def adam_update(
        self,
        p: Array,
        g: Grad,
        m: Array,
        v: Array,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        step: int,
    ) -> None:
        """Adam (Kingma & Ba) with bias correction folded into the step size."""
        g = self.summed(g)
        m *= beta1
        m += (1 - beta1) * g
        self.flush_subnormal(m)
        v *= beta2
        v += (1 - beta2) * (g * g)
        self.flush_subnormal(v)
        c1 = 1 - beta1**step
        c2 = 1 - beta2**step
        p -= (lr / c1) * (m / (self.xp.sqrt(v / c2) + eps))


class NumpyKernels(NumpyConvKernels, Kernels):
    """NumPy-API kernels (NumPy and CuPy): write results into existing buffers with ``out=``."""

    def matmul_into(self, a: Array, b: Array, out: Array) -> Array:
        return self.xp.matmul(a, b, out=out)

    def bias_act(self, z: Array, b: Array, act: str) -> Array:
        xp = self.xp
        z += b
        if act == "relu":
            return xp.maximum(z, 0, out=z)
        if act == "tanh":
            return xp.tanh(z, out=z)
        return self.activation(z, act)

    def one_hot(self, labels: Array, num_classes: int, dtype: Any) -> Array:
        out = self.xp.zeros((labels.shape[0], num_classes), dtype=dtype)
        out[self.xp.arange(labels.shape[0]), labels] = 1
        return out

    def pick(self, logits: Array, labels: Array) -> Array:
        return logits[self.xp.arange(labels.shape[0]), labels]


class HostLabelChecks:
    """Labels on the host: a pass over the N labels is cheap there (on a GPU it would wait for
    the device), and the kernels that index by label must not read outside their arrays."""

    def check_labels(self, logits: Array, labels: Array) -> None:
        super().check_labels(logits, labels)  # type: ignore[misc]
        check_label_values(labels, logits.shape[1])


@cache
def _exponent_bits(xp: ModuleType, dtype: Any) -> Any:
    """The exponent field of a float dtype, as an integer of its size (the bits of infinity)."""
    return xp.asarray(xp.inf, dtype=dtype).view(f"i{xp.dtype(dtype).itemsize}")[()]


class HostKernels(HostLabelChecks, NumpyKernels):
    """NumPy on the CPU: the optimizer updates run a cache-sized chunk at a time.

    Written over whole buffers, Adam's formula is a dozen NumPy passes over memory the size of
    the model, each allocating a model-sized temporary (3.4 ms for the 1.86 M parameters of the
    MLP 784-1024-1024-10, against 0.63 ms for Numba's fused loop). Chunk by chunk, the same
    operations in the same order (so the same bits) find their operands and temporaries in
    cache, and the model's buffers are read and written about once: 2.7 ms. What is left of
    the gap is NumPy's per-element cost of a dozen ufunc calls against one loop. Not for CuPy:
    a GPU kernel per chunk would be slower than whole buffers.
    """

    # values per chunk (256 KiB of float32 per operand): the fastest here, 1.86 M-value Adam in
    # 2.7 ms against 3.1 ms at 2**14 and 2.8 ms at 2**18; 2**12 pays Python per call (5.8 ms)
    CHUNK = 1 << 16

    def _chunks(self, p: Array, g: Grad):
        """Yield (slice, the gradient's values over it): a view, or the rows summed in scratch."""
        rows = g if isinstance(g, tuple) else (g,)
        total = self.xp.empty(min(p.size, self.CHUNK), p.dtype) if len(rows) > 1 else None
        for lo in range(0, p.size, self.CHUNK):
            part = slice(lo, min(p.size, lo + self.CHUNK))
            if total is None:
                yield part, rows[0][part]
                continue
            here = total[: part.stop - lo]
            self.xp.add(rows[0][part], rows[1][part], out=here)
            for row in rows[2:]:
                here += row[part]
            yield part, here

    def sgd_update(self, p: Array, g: Grad, lr: float) -> None:
        scratch = self.xp.empty(min(p.size, self.CHUNK), p.dtype)
        for part, gi in self._chunks(p, g):
            step = self.xp.multiply(lr, gi, out=scratch[: gi.size])
            p[part] -= step

    def _flush_subnormal(self, x: Array, scratch: Array, mask: Array) -> None:
        """``flush_subnormal`` on a chunk, in its scratch buffers and without a branch: a value
        whose exponent bits are all 0 (zero or subnormal) is multiplied, as an integer, by 0.
        (``copyto(x, 0, where=abs(x) < tiny)`` gave the same bits 4x slower in training, where
        the zeros are scattered and every other element mispredicts a branch.)"""
        xp = self.xp
        ints = xp.dtype(f"i{x.dtype.itemsize}")
        bits, scratch_bits = x.view(ints), scratch.view(ints)
        xp.bitwise_and(bits, _exponent_bits(xp, x.dtype), out=scratch_bits)
        xp.not_equal(scratch_bits, 0, out=mask)  # normal, infinite or NaN: kept
        xp.multiply(bits, mask, out=bits)

    def momentum_update(self, p: Array, g: Grad, v: Array, lr: float, mu: float) -> None:
        scratch = self.xp.empty(min(p.size, self.CHUNK), p.dtype)
        mask = self.xp.empty(scratch.shape, bool)
        for part, gi in self._chunks(p, g):
            vi, ts, tm = v[part], scratch[: gi.size], mask[: gi.size]
            vi *= mu
            vi += gi
            self._flush_subnormal(vi, ts, tm)
            p[part] -= self.xp.multiply(lr, vi, out=ts)

    def adam_update(self, p, g, m, v, lr, beta1, beta2, eps, step) -> None:  # noqa: ANN001
        xp = self.xp
        c1, c2 = 1 - beta1**step, 1 - beta2**step
        a = xp.empty(min(p.size, self.CHUNK), p.dtype)
        b = xp.empty_like(a)
        mask = xp.empty(a.shape, bool)
        for part, gi in self._chunks(p, g):
            mi, vi, ta, tb, tm = m[part], v[part], a[: gi.size], b[: gi.size], mask[: gi.size]
            mi *= beta1
            mi += xp.multiply(1 - beta1, gi, out=ta)
            self._flush_subnormal(mi, ta, tm)
            vi *= beta2
            xp.multiply(gi, gi, out=ta)
            vi += xp.multiply(1 - beta2, ta, out=ta)
            self._flush_subnormal(vi, ta, tm)
            xp.divide(vi, c2, out=tb)
            xp.sqrt(tb, out=tb)
            tb += eps
            xp.divide(mi, tb, out=ta)
            p[part] -= xp.multiply(lr / c1, ta, out=ta)
