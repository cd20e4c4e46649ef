"""Scratch memory stays bounded when layers see several batch sizes: a convolution keeps one
pair of buffers, the size of the largest batch, and evaluation runs in slices of the training
batch, so it allocates no scratch of its own (the CNN's evaluation at 1,000 samples took the
process's peak memory past PyTorch's on the same run)."""

import numpy as np
import pytest

from xpnn.backends import get_backend
from xpnn.nn import Context, Flatten, Sequential
from xpnn.nn.conv import Conv2D
from xpnn.nn.dense import Dense
from xpnn.nn.pool import MaxPool2D


def _net() -> Sequential:
    return Sequential([Conv2D(4, 3, activation="relu"), MaxPool2D(2), Flatten(), Dense(3)])


def _convs(model: Sequential) -> list[Conv2D]:
    return [layer for top in model.layers for layer in top.walk() if isinstance(layer, Conv2D)]


def _scratch_values(model: Sequential) -> int:
    return sum(b.size for layer in _convs(model) for b in layer._buffers)


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_a_conv_keeps_one_pair_of_buffers_whatever_the_batch_sizes(backend):
    b = get_backend(backend, "float64")
    model = _net().build((2, 9, 9), b, 0)
    conv = _convs(model)[0]
    rng = np.random.default_rng(0)
    sizes = {}
    for n in (8, 3, 8, 5, 1):
        x, y = rng.random((n, 2, 9, 9)), rng.integers(0, 3, n)
        model.loss_and_grads(x, y, Context(train=True), 1 / n)
        sizes[n] = _scratch_values(model)
        assert len(conv._buffers) == 2
    positions = conv.used_hw[0] * conv.used_hw[1]  # 6x6: the pool reads no more
    per_sample = (2 * 9 + 4) * positions  # (C_in*kh*kw + C_out) values per output position
    assert set(sizes.values()) == {8 * per_sample}  # the largest batch's pair, never more


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_evaluation_reuses_trainings_buffers_and_scores_every_sample(backend):
    b = get_backend(backend, "float64")
    model = _net().build((2, 9, 9), b, 0)
    rng = np.random.default_rng(1)
    x, y = rng.random((6, 2, 9, 9)), rng.integers(0, 3, 6)
    model.loss_and_grads(x, y, Context(train=True), 1 / 6)
    trained = _scratch_values(model)
    xs, ys = rng.random((45, 2, 9, 9)), rng.integers(0, 3, 45)
    loss, correct = model.evaluate(xs, ys)
    assert _scratch_values(model) == trained  # slices of 6: no new scratch
    want_loss, want_correct = 0.0, 0
    for i in range(45):  # one sample at a time, through the same weights
        logits = model.forward(xs[i : i + 1], Context())
        z = logits[0] - logits[0].max()
        want_loss += float(np.log(np.exp(z).sum()) - z[ys[i]])
        want_correct += int(np.argmax(logits[0]) == ys[i])
    assert int(correct) == want_correct
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-12)


def test_an_untrained_model_evaluates_its_batch_whole():
    model = _net().build((2, 9, 9), get_backend("numpy", "float64"), 0)
    rng = np.random.default_rng(2)
    loss, correct = model.evaluate(rng.random((7, 2, 9, 9)), rng.integers(0, 3, 7))
    conv = model.layers[0]
    assert conv.cols.shape[1] == 7 * conv.used_hw[0] * conv.used_hw[1]
    assert np.isfinite(float(loss))
    assert 0 <= int(correct) <= 7
