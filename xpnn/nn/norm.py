"""Layer normalisation over the last axis (Ba, Kiros & Hinton, 2016)."""

from __future__ import annotations

from typing import Any

from xpnn.nn.layer import Array, Context, Layer


class LayerNorm(Layer):
    """``y = gamma * (x - mean) / sqrt(var + eps) + beta`` over the last axis, per position.
    Parameters: ``gamma`` (D,) starting at 1, ``beta`` (D,) starting at 0."""

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
        xp = self.xp
        if x.dtype != self.params["gamma"].dtype:
            x = xp.asarray(x, dtype=self.params["gamma"].dtype)
        centred = x - xp.mean(x, axis=-1, keepdims=True)
        self.inv_std = 1.0 / xp.sqrt(xp.mean(centred * centred, axis=-1, keepdims=True) + self.eps)
        self.xhat = centred * self.inv_std
        return self.xhat * self.params["gamma"] + self.params["beta"]

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        xp = self.xp
        lead = tuple(range(dy.ndim - 1))  # every axis but the features
        self.grads["gamma"][...] = xp.sum(dy * self.xhat, axis=lead)
        self.grads["beta"][...] = xp.sum(dy, axis=lead)
        if not need_dx:
            return None
        g = dy * self.params["gamma"]
        mean_g = xp.mean(g, axis=-1, keepdims=True)
        mean_gx = xp.mean(g * self.xhat, axis=-1, keepdims=True)
        return (g - mean_g - self.xhat * mean_gx) * self.inv_std

    def __repr__(self) -> str:
        return "LayerNorm()"
