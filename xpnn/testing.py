"""Checks for your own layers: ``check_layer`` compares ``backward`` with finite differences."""

from collections.abc import Callable

import numpy as np

from xpnn.backends import get_backend
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
    atol: float = 1e-6,
    x_shape: tuple[int, ...] | None = None,
    before_forward: Callable[[Layer], None] | None = None,
    backend: str = "numpy",
) -> Sequential:
    """``layer``'s float64 gradients against finite differences; ``x_shape``: a sliced input's."""
    arrays = get_backend(backend, "float64")
    host = arrays.to_host
    model = Sequential([layer]).build(in_shape, arrays, 0)
    if before_forward is not None:
        before_forward(layer)
    rng = np.random.default_rng(1)
    x = arrays.asarray(rng.standard_normal((batch, *(x_shape or in_shape))))
    ctx = Context(train=True, step=1, seed=3, sample_ids=np.arange(batch))
    r = rng.standard_normal(layer.forward(x, ctx).shape)

    def f() -> float:
        return float(np.sum(host(layer.forward(x, ctx)) * r))

    layer.forward(x, ctx)
    model.grads[...] = 0
    first = _backward(layer, arrays, r, tuple(x.shape))  # once, then again: a backward that
    firsts = {name: host(g).copy() for name, g in layer.grads.items()}  # adds differs now
    layer.forward(x, ctx)  # a backward may consume what its forward kept
    dx = _backward(layer, arrays, r, tuple(x.shape))
    _compare("the input", dx, numeric_grad(f, host(x)), atol, first)
    for name, p in layer.params.items():
        numeric = numeric_grad(f, host(p))
        _compare(f"parameter {name!r}", host(layer.grads[name]), numeric, atol, firsts[name])
    return model


def _backward(layer: Layer, arrays: object, r: np.ndarray, x_shape: tuple[int, ...]) -> np.ndarray:
    """The input gradient of one ``backward`` on a fresh copy of ``r``, checked for its shape."""
    dx = layer.backward(arrays.asarray(r.copy()), need_dx=True)  # type: ignore[attr-defined]
    shape = getattr(dx, "shape", None)
    if shape is None or tuple(shape) != x_shape:
        got = f"shape {tuple(shape)}" if shape is not None else f"a {type(dx).__name__}"
        raise AssertionError(
            f"{type(layer).__name__}.backward returned {got} as the input's gradient; the input "
            f"has shape {x_shape} (one gradient value per input value)"
        )
    return np.array(arrays.to_host(dx), copy=True)  # type: ignore[attr-defined]


def _compare(
    what: str, got: np.ndarray, numeric: np.ndarray, atol: float, first: np.ndarray
) -> None:
    """``first``: the first of two backward calls (``got`` is the second's)."""
    if np.allclose(got, numeric, rtol=1e-5, atol=atol):
        return
    if np.allclose(first, numeric, rtol=1e-5, atol=atol):
        raise AssertionError(
            f"gradient of {what}: right after one forward and backward, wrong after a second: "
            "backward adds to its gradients (+=) instead of assigning them (grads[name][...] = ...)"
        )
    at = np.unravel_index(int(np.argmax(np.abs(got - numeric))), got.shape) if got.ndim else ()
    raise AssertionError(
        f"gradient of {what} differs from finite differences, most at index {tuple(map(int, at))}: "
        f"backward gave {float(got[at]):.6g}, finite differences {float(numeric[at]):.6g} "
        f"(difference {abs(float(got[at]) - float(numeric[at])):.3g}, atol {atol:g}, rtol 1e-05)"
    )
