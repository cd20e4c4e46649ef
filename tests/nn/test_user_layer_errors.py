"""A user's layer that fails, or returns a wrong shape (even one that broadcasts), is named by
its position, class and call; library layers are not wrapped."""

import numpy as np
import pytest

from xpnn.backends import get_backend
from xpnn.nn import Context, Dense, Flatten, Layer, LayerError, Sequential


class Broken(Layer):
    """A scale layer whose forward or backward goes wrong as ``mode`` says."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode

    def setup(self, in_shape, rng):
        self.add_param("s", 1.0, in_shape)
        return in_shape

    def forward(self, x, ctx):
        self.x = x
        return x[:, :3] if self.mode == "narrow" else x * self.params["s"]

    def backward(self, dy, need_dx=True):
        self.grads["s"][...] = self.xp.sum(dy * self.x, axis=0)
        dx = dy * self.params["s"]
        if self.mode == "raise":
            raise ValueError("operands could not be broadcast together")
        return {"first": dx[:1], "sum": dx.sum(0), "scalar": dx.sum(), "list": [1.0]}.get(
            self.mode, dx
        )


def _step(mode: str) -> None:
    model = Sequential([Flatten(), Dense(5), Broken(mode), Dense(4)])
    model.build((2, 3), get_backend("numpy", "float64"), 0)
    x = np.random.default_rng(0).standard_normal((6, 2, 3))
    model.loss_and_grads(x, np.arange(6) % 4, Context(train=True), 1 / 6)


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("first", r"backward returned shape \(1, 5\) as the gradient of its input, "
                  r"expected shape \(6, 5\)"),
        ("sum", r"backward returned shape \(5,\)"),
        ("scalar", r"backward returned shape \(\)"),
        ("list", r"backward returned a list"),
        ("raise", r"backward: ValueError: operands could not be broadcast together"),
        ("narrow", r"forward returned shape \(6, 3\) as its output, expected shape \(6, 5\)"),
    ],
)  # fmt: skip
def test_a_broken_user_layer_is_named(mode, message):
    with pytest.raises(LayerError, match=r"`model` layer 2 \(Broken\) " + message) as info:
        _step(mode)
    assert "XPNN_DEBUG=1" in str(info.value)


def test_a_correct_user_layer_trains():
    _step("ok")


def test_library_layers_raise_their_own_errors():
    model = Sequential([Flatten(), Dense(5)]).build((2, 3), get_backend("numpy", "float64"), 0)
    with pytest.raises(ValueError) as info:
        model.forward(np.ones((4, 7)), Context(train=True))
    assert not isinstance(info.value, LayerError)
