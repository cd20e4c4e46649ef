"""``xpnn.testing.check_layer`` on broken layers: it names the input or the parameter whose
gradient is wrong with its largest difference, and catches a backward that adds to its
gradients (``+=``) and one that returns a gradient of the wrong shape."""

import pytest

from xpnn.nn import Layer
from xpnn.testing import check_layer


class Scale(Layer):
    """y = x * s; ``bug`` breaks its backward one way."""

    def __init__(self, bug: str = "") -> None:
        super().__init__()
        self.bug = bug

    def setup(self, in_shape, rng):
        self.add_param("s", 1.0, in_shape)
        return in_shape

    def forward(self, x, ctx):
        self.x = x
        return x * self.params["s"]

    def backward(self, dy, need_dx=True):
        g = self.xp.sum(dy * self.x, axis=0)
        if self.bug == "accumulate":
            self.grads["s"][...] += g
        else:
            self.grads["s"][...] = 2 * g if self.bug == "param" else g
        dx = dy * self.params["s"]
        if self.bug == "input":
            dx = dx * 1.5
        return dx[:1] if self.bug == "shape" else dx


def test_a_right_layer_passes():
    check_layer(Scale(), (4,))


@pytest.mark.parametrize(
    ("bug", "message"),
    [
        ("input", r"gradient of the input differs from finite differences, most at index \("),
        ("param", r"gradient of parameter 's' differs from finite differences, most at index"),
        ("accumulate", r"gradient of parameter 's': .* adds to its gradients \(\+=\)"),
        ("shape", r"Scale.backward returned shape \(1, 4\) as the input's gradient; the input "
                  r"has shape \(3, 4\)"),
    ],
)  # fmt: skip
def test_a_broken_backward_is_named(bug, message):
    with pytest.raises(AssertionError, match=message) as info:
        check_layer(Scale(bug), (4,))
    if bug in ("input", "param"):
        assert "backward gave" in str(info.value) and "finite differences" in str(info.value)
