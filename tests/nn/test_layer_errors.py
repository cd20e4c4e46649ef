"""Layers built or wired wrongly through the library API say what is wrong, at build time."""

import numpy as np
import pytest

from xpnn.nn import Dense, Flatten
from xpnn.nn.conv import Conv2D
from xpnn.nn.dropout import Dropout
from xpnn.nn.layer import Context
from xpnn.nn.pool import MaxPool2D
from xpnn.nn.sequential import Sequential


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Dense(4, activation="swish"), "unknown activation 'swish'"),
        (lambda: MaxPool2D(0), "MaxPool2D: size must be >= 1, got 0"),
        (lambda: MaxPool2D(2, stride=0), "MaxPool2D: stride must be >= 1, got 0"),
        (lambda: Conv2D(0, 3), "Conv2D: out_channels must be >= 1, got 0"),
        (lambda: Conv2D(4, 3, padding=-1), "Conv2D: padding must be >= 0, got -1"),
    ],
)
def test_bad_layer_arguments_are_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize(
    ("layers", "shape", "message"),
    [
        ([Dense(4)], (), "Dense expects inputs with a feature axis"),
        ([Flatten(), MaxPool2D(2)], (1, 6, 6), r"MaxPool2D expects \(C, H, W\)"),
        ([Flatten(), Conv2D(2, 3)], (1, 6, 6), r"Conv2D expects \(C, H, W\)"),
        ([Conv2D(2, 7)], (1, 6, 6), "Conv2D kernel 7x7 larger than input"),
    ],
)
def test_layers_that_do_not_fit_their_input_are_refused_at_build(layers, shape, message):
    with pytest.raises(ValueError, match=message):
        Sequential(layers).setup(shape, _numpy(), 0)


def test_conv_output_limit_outside_its_outputs_is_refused():
    conv = Conv2D(2, 3)
    conv.setup((1, 6, 6), np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"limit_output\(5, 4\) outside"):
        conv.limit_output(5, 4)


@pytest.mark.parametrize(
    ("layer", "dy_shape"), [(MaxPool2D(2), (2, 1, 2, 2)), (Dropout(0.5), None)]
)
def test_a_first_layer_without_parameters_returns_no_input_gradient(layer, dy_shape):
    """``need_dx=False`` (nothing before it needs a gradient): no work, None."""
    Sequential([layer, Flatten(), Dense(3)]).build((1, 4, 4), _numpy(), 0)
    x = np.ones((2, 1, 4, 4))
    y = layer.forward(x, Context(train=True, step=0, seed=0, sample_ids=np.arange(2)))
    assert layer.backward(np.ones_like(y), need_dx=False) is None
    assert layer.backward(np.ones_like(y), need_dx=True).shape == x.shape


def _numpy():
    from xpnn.backends import get_backend

    return get_backend("numpy", "float64")
