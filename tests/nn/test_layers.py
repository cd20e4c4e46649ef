"""Every layer's and loss's backward pass against central finite differences (float64)."""

import numpy as np
import pytest

from xpnn.backends import get_backend
from xpnn.nn import Dense, Flatten, ReLU, Sigmoid, Tanh, mlp
from xpnn.nn.layer import Context
from xpnn.testing import check_layer, numeric_grad


@pytest.mark.parametrize("act", ["identity", "relu", "sigmoid", "tanh"])
def test_dense_backward_matches_finite_differences(act):
    check_layer(Dense(5, act), (7,), batch=4)


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_dense_with_a_fused_gelu_matches_finite_differences(backend):
    check_layer(Dense(5, "gelu"), (7,), batch=4, backend=backend)


@pytest.mark.parametrize("layer", [ReLU, Sigmoid, Tanh])
def test_activation_backward_matches_finite_differences(layer):
    check_layer(layer(), (6,), batch=3)


def test_flatten_backward_is_reshape():
    check_layer(Flatten(), (2, 3, 2), batch=2)


def test_dense_skips_input_gradient_when_not_needed():
    backend = get_backend("numpy", "float64")
    layer = Dense(3)
    from xpnn.nn.sequential import Sequential

    Sequential([layer]).build((4,), backend, 0)
    layer.forward(np.ones((2, 4)), Context())
    assert layer.backward(np.ones((2, 3)), need_dx=False) is None
    assert np.all(layer.grads["W"] == 2.0)


@pytest.mark.parametrize("loss", ["softmax_cross_entropy", "sigmoid_bce"])
def test_loss_gradient_matches_finite_differences(loss):
    backend = get_backend("numpy", "float64")
    k = backend.kernels
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, 4)) * 3
    labels = np.array([0, 3, 1, 1, 2])
    fn = {
        "softmax_cross_entropy": k.softmax_cross_entropy,
        "sigmoid_bce": k.sigmoid_binary_cross_entropy,
    }[loss]
    _, grad = fn(logits, labels, 0.5)
    numeric = numeric_grad(lambda: 0.5 * float(fn(logits, labels, 1.0)[0]), logits)
    np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-8)


def test_losses_are_stable_for_large_logits():
    k = get_backend("numpy", "float64").kernels
    logits = np.array([[1000.0, -1000.0], [-1000.0, 1000.0]])
    labels = np.array([0, 0])
    loss, grad = k.softmax_cross_entropy(logits, labels, 1.0)
    assert np.isfinite(loss) and np.isclose(float(loss), 2000.0)
    loss, grad = k.sigmoid_binary_cross_entropy(logits, labels, 1.0)
    assert np.isfinite(loss) and np.all(np.isfinite(grad))


def test_whole_mlp_gradient_matches_finite_differences():
    backend = get_backend("numpy", "float64")
    model = mlp((6, 5), "tanh").build((1, 2, 3), backend, 0)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 1, 2, 3))
    y = np.array([0, 9, 4, 4])

    def f() -> float:
        return float(model.evaluate(x, y)[0]) / 4

    model.loss_and_grads(x, y, Context(train=True), 1 / 4)
    np.testing.assert_allclose(model.grads, numeric_grad(f, model.params), rtol=1e-5, atol=1e-8)


def test_parameters_and_gradients_are_views_of_the_flat_buffers():
    backend = get_backend("numpy", "float32")
    model = mlp((8,)).build((4,), backend, 0)
    names = model.named_params()
    assert list(names) == ["layer0.W", "layer0.b", "layer1.W", "layer1.b"]
    assert sum(p.size for p in names.values()) == model.size == model.params.size
    model.params[...] = 7
    assert all(np.all(p == 7) for p in names.values())
