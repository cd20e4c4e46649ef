"""Layers without parameters: activations (Dense fuses its own; convolutions use these), Flatten."""

import math

from xpnn.nn.layer import Array, Context, Layer


class Activation(Layer):
    """Elementwise nonlinearity; backward uses the output, which all of ours allow."""

    tensor_split = "elementwise"
    kind = "identity"

    def forward(self, x: Array, ctx: Context) -> Array:
        self.y = self.kernels.activation(x, self.kind)
        return self.y

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        return self.kernels.activation_grad(dy, self.y, self.kind) if need_dx else None


class ReLU(Activation):
    kind = "relu"


class Sigmoid(Activation):
    kind = "sigmoid"


class Tanh(Activation):
    kind = "tanh"


class GELU(Layer):
    """``y = x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``, the tanh form GPT-2 uses."""

    tensor_split = "elementwise"

    def forward(self, x: Array, ctx: Context) -> Array:
        self.x = x
        y, self.t = self.kernels.gelu(x)
        return y

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        return self.kernels.gelu_backward(dy, self.x, self.t) if need_dx else None


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
