"""What the loss kernels accept as labels, and what the kernels do with -inf and NaN.

- A label outside [0, K) must raise, naming the label and K: Numba's fused softmax indexes by
  label unchecked (a wrong gradient, or a segfault), NumPy's fancy indexing takes -1 as the
  last class.
- Labels must be a 1-D integer array of length N: a column (N, 1) broadcasts into a wrong
  loss and accuracy on NumPy; float labels failed deep inside a kernel.
- A -inf logit of another class is a finite loss (torch: 1.62652), not -inf * 0 = NaN.
- NaN propagates through ReLU and max-pooling on Numba as on NumPy, so a diverged run shows.
"""

import warnings

import array_api_strict as xs
import numpy as np
import pytest

from xpnn.backends import get_backend
from xpnn.backends.kernels import Kernels
from xpnn.nn.losses import LOSSES

HOST = ["numpy", "numba"]


def _kernels(name):
    return get_backend(name, "float64").kernels


@pytest.mark.parametrize("backend", HOST)
@pytest.mark.parametrize("bad", [3, -1, 10**6])
def test_softmax_xent_label_out_of_range_raises(backend, bad):
    z = np.zeros((2, 3))
    with pytest.raises(ValueError, match=rf"{bad}\b.*3 classes"):
        _kernels(backend).softmax_cross_entropy(z, np.array([0, bad]), 0.5)


@pytest.mark.parametrize("backend", HOST)
@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_losses_reject_labels_out_of_range(backend, loss):
    z = np.zeros((3, 4))
    with pytest.raises(ValueError, match=r"-1\b.*4 classes"):
        LOSSES[loss]()(_kernels(backend), z, np.array([0, -1, 2]), 1.0)
    with pytest.raises(ValueError, match=r"\b4\b.*4 classes"):
        LOSSES[loss]()(_kernels(backend), z, np.array([0, 4, 2]), 1.0)


# labels for 4 rows of logits that every backend refuses, and what it says
BAD_LABELS = [
    (np.array([[0], [1], [2], [0]]), r"1-D.*length 4.*got shape \(4, 1\)"),
    (np.array([0, 1, 2]), r"length 4.*got shape \(3,\)"),
    (np.array([0.0, 1.0, 2.0, 0.0]), r"integer dtype, got float64"),
]


@pytest.mark.parametrize("backend", HOST)
@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("labels, what", BAD_LABELS)
def test_losses_reject_labels_of_wrong_shape_or_dtype(backend, loss, labels, what):
    z = np.zeros((4, 3))
    with pytest.raises(ValueError, match=what):
        LOSSES[loss]()(_kernels(backend), z, labels, 1.0)


@pytest.mark.parametrize("backend", HOST)
def test_count_correct_rejects_a_column_of_labels(backend):
    z = np.array([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0], [1.0, 0.0, 2.0], [0.0, 5.0, 0.0]])
    y = np.array([0, 1, 2, 0])
    assert int(_kernels(backend).count_correct(z, y)) == 3
    with pytest.raises(ValueError, match=r"got shape \(4, 1\)"):
        _kernels(backend).count_correct(z, y[:, None])


def test_array_api_strict_loss_rejects_a_column_of_labels():
    z = xs.zeros((2, 3), dtype=xs.float64)
    with pytest.raises(ValueError, match=r"got shape \(2, 1\)"):
        LOSSES["softmax_cross_entropy"]()(Kernels(xs), z, xs.asarray([[0], [1]]), 1.0)
    with pytest.raises(ValueError, match="integer dtype"):
        LOSSES["softmax_cross_entropy"]()(Kernels(xs), z, xs.asarray([0.0, 1.0]), 1.0)


TORCH_NEGINF = 1.6265233750364456  # torch.nn.functional.cross_entropy(..., reduction="sum")


@pytest.mark.parametrize("backend", ["numpy", "strict"])  # Numba's fused loop was right
def test_softmax_xent_with_a_minus_inf_logit_is_finite(backend):
    z = np.array([[-np.inf, 0.0, 1.0], [2.0, -np.inf, 1.0]])
    y = np.array([1, 0])
    if backend == "strict":
        k, z, y = Kernels(xs), xs.asarray(z), xs.asarray(y)
    else:
        k = _kernels(backend)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss, grad = k.softmax_cross_entropy(z, y, 1.0)
    loss, grad = float(loss), np.asarray(np.from_dlpack(grad) if backend == "strict" else grad)
    assert loss == pytest.approx(TORCH_NEGINF, rel=1e-12)
    assert np.all(np.isfinite(grad)) and grad[0, 0] == 0 and grad[1, 1] == 0


def _with_nans(shape, seed=0):
    x = np.random.default_rng(seed).standard_normal(shape)
    flat = x.reshape(-1)
    flat[:: max(1, flat.size // 7)] = np.nan  # a few NaNs, in windows alongside numbers
    return x


@pytest.mark.parametrize("act", ["relu"])  # the others always propagated NaN
def test_bias_act_propagates_nan_on_numba_as_on_numpy(act):
    z, b = _with_nans((9, 11)), np.random.default_rng(1).standard_normal(11)
    b[3] = -50.0  # a NaN on a column that is otherwise all negative
    want = _kernels("numpy").bias_act(z.copy(), b, act)
    got = _kernels("numba").bias_act(z.copy(), b, act)
    assert np.isnan(want).any()
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("act", ["relu"])
def test_conv_output_propagates_nan_on_numba_as_on_numpy(act):
    shape = (3, 4, 5, 6)  # (N, C, OH, OW)
    yc = _with_nans((4, 3 * 5 * 6))
    b = np.random.default_rng(1).standard_normal(4)
    want = _kernels("numpy").conv_output(yc.copy(), b, shape, act)
    got = _kernels("numba").conv_output(yc.copy(), b, shape, act)
    assert np.isnan(want).any()
    np.testing.assert_array_equal(got, want)


def test_generic_relu_propagates_nan():
    z = np.array([np.nan, -1.0, 2.0])
    y = Kernels(np).activation(z, "relu")
    np.testing.assert_array_equal(y, [np.nan, 0.0, 2.0])


@pytest.mark.parametrize("size, stride", [(2, 2), (3, 3), (3, 2), (2, 1)])
def test_maxpool_propagates_nan_on_numba_as_on_numpy(size, stride):
    x = np.random.default_rng(2).standard_normal((2, 3, 9, 10))
    x[0, 0, 0, 1] = np.nan  # not a window's first element
    x[0, 1, 4, 4] = np.nan
    x[1, 2, 5, 5] = x[1, 2, 5, 4] = np.nan  # two NaNs in one window: the first wins
    x[1, 0, 2, 3] = np.inf
    want_y, want_idx = _kernels("numpy").maxpool2d_forward(x, size, stride)
    got_y, got_idx = _kernels("numba").maxpool2d_forward(x, size, stride)
    gen_y, gen_idx = Kernels(np).maxpool2d_forward(x, size, stride)
    assert np.isnan(want_y).sum() >= 3
    np.testing.assert_array_equal(got_y, want_y)
    np.testing.assert_array_equal(gen_y, want_y)
    np.testing.assert_array_equal(got_idx, want_idx)
    np.testing.assert_array_equal(gen_idx, want_idx)
    dy = np.random.default_rng(3).standard_normal(want_y.shape)
    want_dx = _kernels("numpy").maxpool2d_backward(dy, want_idx, x.shape, size, stride)
    got_dx = _kernels("numba").maxpool2d_backward(dy, got_idx, x.shape, size, stride)
    np.testing.assert_allclose(got_dx, want_dx, rtol=1e-12)  # overlaps: add order
