"""Library-API misuse is refused with a one-line message (not heap corruption, cropped outputs,
garbage reads or silently changed arguments), and checks cost nothing per call beyond shapes."""

import numpy as np
import pytest

from xpnn.backends import get_backend
from xpnn.errors import UserError
from xpnn.nn import Context, Dense, Flatten, Sequential, mlp
from xpnn.nn.conv import Conv2D
from xpnn.nn.losses import SigmoidBinaryCrossEntropy
from xpnn.nn.pool import MaxPool2D
from xpnn.train.optim import Adam, Momentum, Schedule, make_optimizer

BACKENDS = ["numpy", "numba"]


def _model(layers, shape, backend="numpy", dtype="float64", loss=None):
    return Sequential(layers, loss).build(shape, get_backend(backend, dtype), seed=0)


# -- inputs that do not match what a layer was built for --------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(2, 3, 6, 6), (2, 1, 10, 10), (2, 1, 5, 6), (1, 6, 6)])
def test_conv2d_refuses_inputs_other_than_built_for(backend, shape):
    # 3 channels into a 1-channel layer wrote past numba's column buffer; a larger image was
    # silently cropped to the built output size
    m = _model([Conv2D(2, 3)], (1, 6, 6), backend)
    with pytest.raises(ValueError, match=r"Conv2D built for input \(C,H,W\)=\(1, 6, 6\)"):
        m.forward(np.ones(shape), Context())


@pytest.mark.parametrize("backend", BACKENDS)
def test_dense_and_maxpool_refuse_inputs_other_than_built_for(backend):
    dense = _model([Dense(3)], (5,), backend)
    with pytest.raises(ValueError, match="Dense built for 5 input features"):
        dense.forward(np.ones((2, 4)), Context())
    pool = _model([MaxPool2D(2)], (2, 6, 6), backend)
    with pytest.raises(ValueError, match="MaxPool2D built for 2 channels"):
        pool.forward(np.ones((2, 3, 6, 6)), Context())


def test_uint8_images_go_through_conv_models_as_dense_ones_do():
    x = np.random.default_rng(0).integers(0, 255, (2, 1, 6, 6), dtype=np.uint8)
    m = _model([Conv2D(2, 3), Flatten(), Dense(3)], (1, 6, 6))
    np.testing.assert_array_equal(m.forward(x, Context()), m.forward(x.astype(float), Context()))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("conv", [False, True], ids=["dense", "conv"])
def test_float64_input_to_a_float32_network_is_computed_in_float32(backend, conv):
    """A float64 batch (``np.random`` data, say) made the whole pass float64: slower, and
    Conv2D sized its column buffers for it."""
    layers = [Conv2D(2, 3, activation="relu"), Flatten(), Dense(3)] if conv else [Dense(3)]
    shape = (1, 6, 6) if conv else (36,)
    x = np.random.default_rng(0).standard_normal((4, *shape))
    y = np.array([0, 1, 2, 0])
    m = _model(layers, shape, backend, "float32")
    out = m.forward(x, Context())
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, m.forward(x.astype(np.float32), Context()))
    m.loss_and_grads(x, y, Context(train=True), 0.25)
    grads = m.grads.copy()
    m.loss_and_grads(x.astype(np.float32), y, Context(train=True), 0.25)
    np.testing.assert_array_equal(m.grads, grads)


# -- backward leaves the caller's gradient alone ----------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_does_not_overwrite_the_callers_gradient(backend):
    x = np.random.default_rng(0).standard_normal((4, 5))
    m = _model([Dense(6, "relu"), Dense(3, "tanh")], (5,), backend)
    out = m.forward(x, Context(train=True))
    dl = np.ones_like(out)
    m.backward(dl)
    first = m.grads.copy()
    np.testing.assert_array_equal(dl, np.ones_like(out))
    m.forward(x, Context(train=True))
    m.backward(dl)
    np.testing.assert_array_equal(m.grads, first)


# -- optimizers ---------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["sgd", "momentum", "adam"])
def test_optimizer_refuses_grads_that_do_not_match_params(backend, name):
    kernels = get_backend(backend, "float64").kernels
    with pytest.raises(ValueError, match=r"grads of shape \(3,\) do not match params"):
        make_optimizer(name, np.zeros(8), np.ones(3), kernels, Schedule(0.1))
    with pytest.raises(ValueError, match=r"grads of shape \(2,\) do not match"):
        make_optimizer(name, np.zeros(3), (np.ones(3), np.ones(2)), kernels, Schedule(0.1))
    with pytest.raises(ValueError, match="params must be a floating-point array, got int64"):
        make_optimizer(name, np.zeros(3, np.int64), np.ones(3), kernels, Schedule(0.1))


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (Adam, {"beta1": 1.0}, r"Adam: beta1 must be in \[0, 1\), got 1.0"),
        (Adam, {"beta2": 1.0}, r"Adam: beta2 must be in \[0, 1\), got 1.0"),
        (Adam, {"beta1": -0.1}, "Adam: beta1"),
        (Adam, {"eps": -1e-8}, "Adam: eps must be positive"),
        (Adam, {"eps": 0.0}, "Adam: eps must be positive"),
        (Momentum, {"mu": -0.5}, r"Momentum: mu must be in \[0, 1\)"),
        (Momentum, {"mu": 1.0}, r"Momentum: mu must be in \[0, 1\)"),
    ],
)
def test_optimizer_hyperparameters_are_checked(cls, kwargs, message):
    kernels = get_backend("numpy", "float64").kernels
    with pytest.raises(ValueError, match=message):
        cls(np.zeros(3), np.zeros(3), kernels, Schedule(0.1), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "cosine"}, "cosine schedule needs total_steps >= 1, got 0"),
        ({"kind": "step", "gamma": -1.0}, "gamma must be positive, got -1.0"),
        ({"kind": "step", "gamma": 0.0}, "gamma must be positive"),
        ({"kind": "step", "step_size": 0}, "step_size must be >= 1, got 0"),
        ({"warmup_steps": -1}, "warmup_steps and total_steps must be >= 0"),
        ({"step_size": 2.5}, "step_size must be an int, got 2.5"),
        ({"kind": "linear"}, "unknown schedule 'linear' \\(choose constant, step, cosine\\)"),
    ],
)
def test_bad_schedules_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        Schedule(0.1, **kwargs)
    assert isinstance(info.value, UserError)  # the CLI prints it as one line


def test_schedules_the_trainer_makes_still_work():
    assert Schedule(0.1, "cosine", warmup_steps=3, total_steps=3)(3) == pytest.approx(0.1)
    assert Schedule(0.1, "step", step_size=2, gamma=0.5)(2) == pytest.approx(0.05)
    assert Schedule(0.1, warmup_steps=np.int64(2), total_steps=0)(1) == pytest.approx(0.1)


# -- rebuilding -------------------------------------------------------------------------------
def test_rebuilt_conv_model_does_not_reuse_stale_scratch():
    x = np.random.default_rng(0).standard_normal((2, 2, 6, 6))
    y = np.array([0, 1])
    b32, b64 = get_backend("numpy", "float32"), get_backend("numpy", "float64")

    def layers():
        return [Conv2D(3, 3), Flatten(), Dense(3)]

    ref = Sequential(layers()).build((2, 6, 6), b64, seed=0)
    ref.loss_and_grads(x, y, Context(train=True), 0.5)
    m = Sequential(layers()).build((2, 6, 6), b32, seed=0)
    m.loss_and_grads(b32.asarray(x), y, Context(train=True), 0.5)
    m.build((2, 6, 6), b64, seed=0)
    m.loss_and_grads(x, y, Context(train=True), 0.5)
    np.testing.assert_array_equal(m.grads, ref.grads)
    m.build((3, 6, 6), b64, seed=0)  # 3 channels: scratch sized for 2 does not fit
    m.loss_and_grads(np.ones((2, 3, 6, 6)), y, Context(train=True), 0.5)


# -- constructor arguments --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: Dense(0), ValueError, "Dense: units must be >= 1, got 0"),
        (lambda: Dense(2.5), TypeError, "Dense: units must be an int, got 2.5"),
        (lambda: Conv2D(4, 3, stride=1.5), TypeError, "Conv2D: stride must be an int, got 1.5"),
        (lambda: Conv2D(4, 3.5), TypeError, "Conv2D: kernel_size must be an int, got 3.5"),
        (lambda: Conv2D(4, (3, 3, 3)), ValueError, "Conv2D: kernel_size must be an int or a pair"),
        (lambda: Conv2D(4, 3, stride=(2, 1)), TypeError, "Conv2D: stride and padding must be ints"),
        (lambda: MaxPool2D(2.7), TypeError, "MaxPool2D: size must be an int, got 2.7"),
        (lambda: MaxPool2D((2, 2)), TypeError, "MaxPool2D: size and stride must be ints"),
        (lambda: mlp(loss="bce"), ValueError, "unknown loss 'bce' \\(choose"),
        (lambda: Sequential([Dense(2)], 3), TypeError, "loss must be a loss name or a callable"),
    ],
)
def test_bad_arguments_are_refused_not_changed(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_numpy_integers_and_rectangular_kernels_are_accepted():
    conv = Conv2D(np.int64(4), np.int64(3), stride=np.int32(1), padding=np.int64(1))
    assert (conv.out_channels, conv.kh, conv.kw, conv.stride, conv.padding) == (4, 3, 3, 1, 1)
    assert type(conv.kh) is int
    layers = [Conv2D(2, (3, 2)), MaxPool2D(np.int64(2)), Flatten(), Dense(np.int64(3))]
    m = _model(layers, (1, 6, 6))
    assert m.output_shape == (3,)


def test_sequential_takes_a_loss_name():
    m = _model([Dense(3)], (4,), loss="sigmoid_bce")
    assert isinstance(m.loss, SigmoidBinaryCrossEntropy)
    loss, _ = m.loss_and_grads(np.ones((2, 4)), np.array([0, 1]), Context(), 1.0)
    assert np.isfinite(float(loss))
