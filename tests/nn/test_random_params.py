"""Finite differences at random parameters for every layer class in ``xpnn.nn`` that has
parameters, on every CPU backend (float64). At the initial values (LayerNorm's gamma 1 and beta
0, every bias 0) a backward that drops gamma, or a bias inside an activation's derivative,
passes; here it cannot. ``test_composite.CASES`` covers the sequence layers; this file adds
the rest and checks that no layer class is left out."""

import importlib
import inspect
import pkgutil

import numpy as np
import pytest
from test_composite import BACKENDS, CASES, backend_of, fd_check, random_params

import xpnn.nn
from xpnn.nn import Chain, Dense, LayerNorm, Sequential
from xpnn.nn.conv import Conv2D, Conv2DPool
from xpnn.nn.layer import Layer
from xpnn.nn.pool import MaxPool2D
from xpnn.testing import check_layer


def _normal(*shape: int) -> np.ndarray:
    return np.random.default_rng(4).standard_normal(shape)


MORE_CASES = {
    **{
        f"dense_{act}": (lambda act=act: [Dense(4, act)], (6,), lambda: _normal(3, 6))
        for act in ("identity", "relu", "sigmoid", "tanh")
    },
    **{
        f"conv_{act}": (
            lambda act=act: [Conv2D(3, (3, 2), stride=2, padding=1, activation=act)],
            (2, 5, 4),
            lambda: _normal(2, 2, 5, 4),
        )
        for act in ("identity", "relu", "tanh")
    },
    "conv_relu_pool": (
        lambda: [Conv2DPool(Conv2D(3, 3, activation="relu"), MaxPool2D(2))],
        (2, 7, 6),
        lambda: _normal(2, 2, 7, 6),
    ),
    "chain": (
        lambda: [Chain({"norm": LayerNorm(), "dense": Dense(3, "sigmoid")})],
        (2, 5),
        lambda: _normal(3, 2, 5),
    ),
}
# layers with nothing to learn: a check at random parameters has nothing to perturb
PARAMETER_FREE = {"Layer", "Activation", "ReLU", "Sigmoid", "Tanh", "GELU"}
PARAMETER_FREE |= {"Flatten", "Dropout", "MaxPool2D"}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(MORE_CASES))
def test_backward_at_random_parameters_matches_finite_differences(case, backend):
    make, in_shape, x = MORE_CASES[case]
    fd_check(backend_of(backend), make(), in_shape, x())


def _randomize(layer: Layer) -> None:
    """``check_layer``'s ``before_forward``: every parameter set to ``random_params``."""
    for index, p in enumerate(layer.params.values()):
        host = random_params(int(np.prod(p.shape)), seed=index).reshape(tuple(p.shape))
        p[...] = layer.backend.asarray(host)


@pytest.mark.parametrize("backend", ["numpy", "numba", "torch"])
@pytest.mark.parametrize(
    "make, in_shape",
    [
        (lambda: LayerNorm(), (4, 6)),
        (lambda: Dense(5, "tanh"), (7,)),
        (lambda: Conv2D(2, 3, padding=1, activation="sigmoid"), (2, 4, 5)),
    ],
    ids=["layernorm", "dense_tanh", "conv_sigmoid"],
)
def test_check_layer_at_random_parameters(make, in_shape, backend):
    """The public route: ``check_layer`` with the parameters set after build."""
    layer = make()
    check_layer(layer, in_shape, batch=3, before_forward=_randomize, backend=backend)
    assert all(
        float(np.asarray(layer.backend.to_host(p)).std()) > 0.1 for p in layer.params.values()
    )


def _layer_classes() -> set[type]:
    found = set()
    for info in pkgutil.iter_modules(xpnn.nn.__path__):
        module = importlib.import_module(f"xpnn.nn.{info.name}")
        for obj in vars(module).values():
            if (
                inspect.isclass(obj)
                and issubclass(obj, Layer)
                and obj.__module__ == module.__name__
            ):
                found.add(obj)
    return found


def test_every_layer_class_with_parameters_is_checked_at_random_parameters():
    """A new layer class in ``xpnn.nn`` needs a case here (or in ``test_composite.CASES``),
    or a place in ``PARAMETER_FREE``."""
    be = backend_of("numpy")
    covered, with_params = set(), set()
    for make, in_shape, _ in [*CASES.values(), *MORE_CASES.values()]:
        for top in Sequential(make()).build(in_shape, be, 0).layers:
            for layer in top.walk():
                covered.add(type(layer))
                if layer.initial:
                    with_params.add(type(layer).__name__)
    classes = {cls.__name__ for cls in _layer_classes()}
    missing = classes - PARAMETER_FREE - {cls.__name__ for cls in covered}
    assert not missing, f"layer classes no random-parameter case builds: {sorted(missing)}"
    assert not with_params & PARAMETER_FREE
