"""Stand-alone activation layers (Dense fuses its own; convolutions and GELU use these)."""

from __future__ import annotations

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


GELU_C = math.sqrt(2.0 / math.pi)  # the tanh form's constants (Hendrycks & Gimpel, 2016)
GELU_A = 0.044715


class GELU(Layer):
    """``y = x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``, the tanh form GPT-2 uses."""

    tensor_split = "elementwise"

    def forward(self, x: Array, ctx: Context) -> Array:
        xp = self.xp
        self.x = x
        self.t = xp.tanh(GELU_C * (x + GELU_A * x * x * x))
        return 0.5 * x * (1.0 + self.t)

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        if not need_dx:
            return None
        x, t = self.x, self.t
        inner = GELU_C * (1.0 + 3.0 * GELU_A * x * x)
        return dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * inner)
