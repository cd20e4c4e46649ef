"""A layer of your own: PReLU (He et al., 2015), ``y = x`` where ``x > 0``, else ``alpha * x``,
with one learned ``alpha`` per feature. Run it to check its gradients against finite
differences, at its initial parameters and at random ones:

    python examples/own_layer.py

``examples/own_model.py`` puts it in a network that ``python -m xpnn --model`` trains."""

from __future__ import annotations

import numpy as np

from xpnn.nn import Layer
from xpnn.testing import check_layer


class PReLU(Layer):
    """``y = max(x, 0) + alpha * min(x, 0)``; ``alpha`` (features,) starts at 0.25."""

    def setup(self, in_shape, rng):
        self.add_param("alpha", 0.25, (in_shape[-1],))  # a constant start needs its shape
        return in_shape

    def forward(self, x, ctx):
        xp = self.xp
        self.x = x  # what backward needs
        return xp.maximum(x, 0) + self.params["alpha"] * xp.minimum(x, 0)

    def backward(self, dy, need_dx=True):
        xp = self.xp
        negative = xp.minimum(self.x, 0)
        lead = tuple(range(dy.ndim - 1))  # every axis but the features
        self.grads["alpha"][...] = xp.sum(dy * negative, axis=lead)  # assign, never add
        if not need_dx:
            return None
        slope = xp.where(self.x > 0, xp.ones_like(self.x), self.params["alpha"])
        return dy * slope


def random_alpha(layer: Layer) -> None:
    """``check_layer``'s ``before_forward``: parameters away from their initial values, where
    a backward that forgets one of them cannot pass by luck."""
    alpha = layer.params["alpha"]
    alpha[...] = np.random.default_rng(1).uniform(-1.0, 1.0, alpha.shape)


if __name__ == "__main__":
    check_layer(PReLU(), (6,), batch=4)
    check_layer(PReLU(), (3, 5), batch=2, before_forward=random_alpha)  # (N, T, D) inputs too
    print("PReLU: gradients match finite differences")
