"""Inverted dropout; its mask hashes (seed, step, sample id, element), the same on any rank."""

from xpnn.nn.layer import Array, Context, Layer


class Dropout(Layer):
    """Zeroes each element with probability ``p`` in training; ``salt`` tells two Dropouts apart."""

    repr_attrs = ("p",)

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
        if ids is None:  # the batch positions stand in
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
