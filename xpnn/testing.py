"""Checks for your own layers: ``check_layer`` compares a layer's ``backward`` (the input's
gradient and every parameter's) with central finite differences, in float64."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from xpnn.nn.layer import Context, Layer
from xpnn.nn.sequential import Sequential

__all__ = ["check_layer", "numeric_grad"]


def numeric_grad(f: Callable[[], float], x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """d f / d x by central differences, perturbing ``x`` in place one entry at a time."""
    grad = np.zeros_like(x)
    flat, gflat = x.reshape(-1), grad.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + eps
        fp = f()
        flat[i] = old - eps
        fm = f()
        flat[i] = old
        gflat[i] = (fp - fm) / (2 * eps)
    return grad


def check_layer(
    layer: Layer,
    in_shape: tuple[int, ...],
    batch: int = 3,
    seed: int = 0,
    ctx: Context | None = None,
    atol: float = 1e-6,
    x_shape: tuple[int, ...] | None = None,
    before_forward: Callable[[Layer], None] | None = None,
    backend: str = "numpy",
) -> Sequential:
    """Build ``layer`` on a float64 host backend (``numpy`` or ``torch``); compare dx and every
    dparam with FD of the scalar ``sum(forward(x) * R)`` for a random R. The input and the
    parameters are perturbed through NumPy views of the backend's arrays (zero copy on the CPU).

    ``x_shape``: the input a built layer takes, where it differs from the shape it is built
    against (a slice, under tensor parallelism); ``before_forward(layer)`` runs after build.
    """
    from xpnn.backends import get_backend

    arrays = get_backend(backend, "float64")
    host = arrays.to_host
    model = Sequential([layer]).build(in_shape, arrays, seed)
    if before_forward is not None:
        before_forward(layer)
    rng = np.random.default_rng(seed + 1)
    x = arrays.asarray(rng.standard_normal((batch, *(x_shape or in_shape))))
    ctx = ctx or Context(train=True, step=1, seed=3, sample_ids=np.arange(batch))
    r = rng.standard_normal(layer.forward(x, ctx).shape)

    def f() -> float:
        return float(np.sum(host(layer.forward(x, ctx)) * r))

    layer.forward(x, ctx)
    dx = host(layer.backward(arrays.asarray(r.copy()), need_dx=True))
    np.testing.assert_allclose(dx, numeric_grad(f, host(x)), rtol=1e-5, atol=atol)
    for name, p in layer.params.items():
        np.testing.assert_allclose(
            host(layer.grads[name]), numeric_grad(f, host(p)), rtol=1e-5, atol=atol, err_msg=name
        )
    return model
