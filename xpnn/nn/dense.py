"""Dense (bias and activation fused), the activations as layers of their own, and Flatten."""

import math

from xpnn.backends.kernels import ACTIVATIONS
from xpnn.nn.layer import Array, Context, Layer, check_int, for_activation
from xpnn.record.phases import WGRAD


class Dense(Layer):
    """``y = act(x @ W + b)``, the activation fused so that one kernel touches ``z`` once."""

    tensor_split = "dense"

    def __init__(self, units: int, activation: str = "identity") -> None:
        super().__init__()
        if activation not in (*ACTIVATIONS, "gelu"):
            raise ValueError(f"Dense: unknown activation {activation!r}")
        self.units = check_int("Dense", "units", units)
        self.activation = activation

    def setup(self, in_shape: tuple[int, ...], rng) -> tuple[int, ...]:  # noqa: ANN001
        if len(in_shape) < 1:
            raise ValueError(f"Dense expects inputs with a feature axis, got shape {in_shape}")
        self.add_param("W", for_activation(rng, in_shape[-1], self.units, self.activation))
        self.add_param("b", 0.0, (self.units,))
        return (*in_shape[:-1], self.units)

    def checked(self, x: Array) -> Array:
        """``x`` checked, as rows of features (leading axes merged), in the parameters' dtype."""
        features = self.params["W"].shape[0]
        if x.ndim < 2 or x.shape[-1] != features:
            got = f"got batch shape {tuple(x.shape)}"
            raise ValueError(f"Dense built for {features} input features, {got}")
        if x.ndim > 2:
            x = self.xp.reshape(x, (math.prod(x.shape[:-1]), features))
        if x.dtype != self.params["W"].dtype:
            x = self.xp.asarray(x, dtype=self.params["W"].dtype)
        return x

    def forward(self, x: Array, ctx: Context) -> Array:
        self.lead, self.x = tuple(x.shape[:-1]), self.checked(x)
        return self.activate(self.xp.matmul(self.x, self.params["W"]))

    def activate(self, z: Array) -> Array:
        """``act(z + b)`` of the pre-activation rows ``z`` (kept), with the leading axes back."""
        if self.activation == "gelu":
            self.y, out, self.t = self.kernels.bias_gelu(z, self.params["b"])
            return self._unflat(out)
        self.y = self.kernels.bias_act(z, self.params["b"], self.activation)
        return self._unflat(self.y)

    def _unflat(self, rows: Array) -> Array:
        if len(self.lead) == 1:
            return rows
        return self.xp.reshape(rows, (*self.lead, rows.shape[-1]))

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        if dy.ndim > 2:
            dy = self.xp.reshape(dy, (self.y.shape[0], dy.shape[-1]))
        if self.activation == "gelu":
            dz, db = self.kernels.bias_gelu_backward(dy, self.y, self.t)
        else:
            dz, db = self.kernels.bias_act_backward(dy, self.y, self.activation)
        with WGRAD:
            self.kernels.matmul_into(self.x.T, dz, self.grads["W"])
        self.grads["b"][...] = db
        return self._unflat(self.input_grad(dz)) if need_dx else None

    def input_grad(self, dz: Array) -> Array:
        """``dx = dz @ W.T``: what the layer below receives."""
        return self.xp.matmul(dz, self.params["W"].T)

    def __repr__(self) -> str:
        return f"Dense({self.units}, {self.activation})"


class Activation(Layer):
    """Elementwise nonlinearity ``kind``; backward uses the output, which all of ours allow."""

    tensor_split = "elementwise"

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


class GELU(Activation):
    """``y = x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``, the tanh form GPT-2 uses."""

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
