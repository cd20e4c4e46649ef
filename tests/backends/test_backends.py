"""The backends compute the same network: numba == numpy (float64), array-api-strict == numpy."""

import array_api_strict as xs
import numpy as np
import pytest

from xpnn.backends import get_backend
from xpnn.backends.base import Backend
from xpnn.backends.kernels import Kernels
from xpnn.nn import Context, mlp
from xpnn.train.optim import GradClip, Schedule, make_optimizer, matrix_ranges

RTOL = 1e-10


def _batch(seed=0, n=16):
    rng = np.random.default_rng(seed)
    return rng.random((n, 1, 8, 8)), rng.integers(0, 10, n)


def _run(backend, act="relu", optimizer="adam", steps=2, loss="softmax_cross_entropy"):
    """Forward+backward and ``steps`` optimizer steps; returns host copies of everything."""
    model = mlp((32, 16), act, loss=loss).build((1, 8, 8), backend, seed=5)
    recipe = {}
    if optimizer == "adamw":  # with the recipe's other pieces: decay on matrices, clipping
        shapes = [tuple(layer.params[name].shape) for _, layer, name in model.param_names()]
        recipe = {"matrices": matrix_ranges(shapes), "clip": GradClip(0.05)}
    opt = make_optimizer(
        optimizer, model.params, model.grads, backend.kernels, Schedule(0.01), **recipe
    )
    out = {}
    for step in range(steps):
        x, y = _batch(step)
        x, y = backend.asarray(x), backend.asarray(y, dtype=backend.xp.int64)
        logits = model.forward(x, Context(train=True))
        out[f"logits{step}"] = backend.to_host(logits)
        loss_sum, correct = model.loss_and_grads(x, y, Context(train=True), 1 / 16)
        out[f"loss{step}"] = float(loss_sum)
        out[f"grads{step}"] = backend.to_host(model.grads).copy()
        opt.step()
        out[f"params{step}"] = backend.to_host(model.params).copy()
    return out


def _assert_same(a, b, rtol=RTOL):
    for key in a:
        np.testing.assert_allclose(
            np.asarray(b[key]), np.asarray(a[key]), rtol=rtol, atol=1e-13, err_msg=key
        )


@pytest.mark.parametrize("act", ["relu", "sigmoid", "tanh"])
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam", "adamw"])
def test_numba_equals_numpy_float64(act, optimizer):
    ref = _run(get_backend("numpy", "float64"), act, optimizer)
    _assert_same(ref, _run(get_backend("numba", "float64"), act, optimizer))


def test_numba_equals_numpy_with_sigmoid_bce():
    ref = _run(get_backend("numpy", "float64"), loss="sigmoid_bce")
    _assert_same(ref, _run(get_backend("numba", "float64"), loss="sigmoid_bce"))


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
@pytest.mark.parametrize("act", ["relu", "sigmoid", "tanh"])
def test_array_api_strict_runs_the_same_math(act, optimizer):
    """The generic kernels use only the array API: the proof that the math is portable."""
    strict = Backend(xs, Kernels(xs), "float64")
    strict.to_host = lambda a: np.from_dlpack(a)
    ref = _run(get_backend("numpy", "float64"), act, optimizer)
    _assert_same(ref, _run(strict, act, optimizer), rtol=1e-12)


def test_float32_is_the_default_dtype():
    backend = get_backend("numba")
    model = mlp((8,)).build((4,), backend, 0)
    assert model.params.dtype == np.float32 and model.grads.dtype == np.float32


def test_same_seed_same_initial_parameters_on_every_backend():
    a = mlp((8,)).build((4,), get_backend("numpy", "float64"), 3).params
    b = mlp((8,)).build((4,), get_backend("numba", "float64"), 3).params
    c = mlp((8,)).build((4,), get_backend("numpy", "float64"), 4).params
    assert np.array_equal(a, b) and not np.array_equal(a, c)
