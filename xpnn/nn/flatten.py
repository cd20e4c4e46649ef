"""Flatten: the bridge from image-shaped to vector-shaped activations."""

import math

from xpnn.nn.layer import Array, Context, Layer


class Flatten(Layer):
    """``(N, *shape) -> (N, prod(shape))``."""

    tensor_split = "replicate"

    def setup(self, in_shape: tuple[int, ...], rng) -> tuple[int, ...]:  # noqa: ANN001
        self.in_shape = in_shape
        return (math.prod(in_shape),)

    def forward(self, x: Array, ctx: Context) -> Array:
        return self.xp.reshape(x, (x.shape[0], math.prod(self.in_shape)))  # -1: not at 0 rows

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        return self.xp.reshape(dy, (dy.shape[0], *self.in_shape)) if need_dx else None
