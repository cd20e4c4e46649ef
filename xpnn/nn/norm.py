"""Layer normalisation over the last axis (Ba, Kiros & Hinton, 2016)."""

from typing import Any

from xpnn.nn.layer import Array, Context, Layer


class LayerNorm(Layer):
    """``y = gamma * (x - mean) / sqrt(var + eps) + beta`` over the last axis, per position."""

    def __init__(self, eps: float = 1e-5) -> None:
        super().__init__()
        if not eps > 0:
            raise ValueError(f"LayerNorm: eps must be > 0, got {eps!r}")
        self.eps = float(eps)

    def setup(self, in_shape: tuple[int, ...], rng: Any) -> tuple[int, ...]:
        if len(in_shape) < 1:
            raise ValueError(f"LayerNorm expects inputs with a feature axis, got shape {in_shape}")
        self.add_param("gamma", 1.0, (in_shape[-1],))
        self.add_param("beta", 0.0, (in_shape[-1],))
        return in_shape

    def forward(self, x: Array, ctx: Context) -> Array:
        gamma, beta = self.params["gamma"], self.params["beta"]
        if x.dtype != gamma.dtype:
            x = self.xp.asarray(x, dtype=gamma.dtype)
        y, self.xhat, self.inv_std = self.kernels.layer_norm(x, gamma, beta, self.eps)
        return y

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        dx, dgamma, dbeta = self.kernels.layer_norm_backward(
            dy, self.xhat, self.inv_std, self.params["gamma"], need_dx
        )
        self.grads["gamma"][...] = dgamma
        self.grads["beta"][...] = dbeta
        return dx
