"""Inverted dropout whose mask is a pure function of (seed, step, sample id, element).

The mask comes from a counter-based hash (``kernels.dropout_mask``), not from a random
generator's stream, so a sample's mask does not depend on the rank, the batch it landed in or
its position there, nor on the backend: N ranks compute what 1 rank computes, and numba, numpy
and cupy draw bit-identical masks.
"""

from __future__ import annotations

from xpnn.nn.layer import Array, Context, Layer


class Dropout(Layer):
    """Train mode: zero each element with probability ``p``, scale the rest by ``1/(1-p)``.

    Eval mode: the identity. The mask is keyed by ``ctx.seed``, ``ctx.step`` and
    ``ctx.sample_ids`` (the samples' indices in the data set); when ``ctx.sample_ids`` is None
    the batch positions ``0..N-1`` stand in for them (then masks do depend on batch position).
    ``salt`` tells apart several Dropout layers of one model (same shape, same keys otherwise
    means the same mask). Without ``ctx.step`` the layer's own count of training passes keys
    the mask: a loop that passes ``Context(train=True)`` each step must not get one mask for
    the whole run.
    """

    def __init__(self, p: float = 0.5, salt: int = 0) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"Dropout probability must be in [0, 1), got {p}")
        self.p = float(p)
        self.salt = int(salt)
        self.mask: Array | None = None
        self.passes = 0  # training passes without a ctx.step: the step that keys the mask

    def forward(self, x: Array, ctx: Context) -> Array:
        if not ctx.train or self.p == 0.0:
            self.mask = None
            return x
        ids = ctx.sample_ids
        if ids is None:
            ids = self.xp.arange(x.shape[0], dtype=self.xp.int64)
        step = ctx.step
        if step is None:
            step, self.passes = self.passes, self.passes + 1
        self.mask = self.kernels.dropout_mask(
            tuple(x.shape), self.p, ctx.seed, step, ids, x.dtype, self.salt
        )
        return x * self.mask

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        if not need_dx:
            return None
        return dy if self.mask is None else dy * self.mask

    def __repr__(self) -> str:
        return f"Dropout({self.p})"
