"""What the CuPy kernels do with bad labels, -inf and NaN: the same as the NumPy backend,
except that a label outside [0, K) is not checked on the host (that would sync the device
every step): the CUDA loss kernel makes that row's loss and gradient NaN instead of reading
outside the row, so the run stops as diverged rather than training on garbage.

Skipped, with the reason, where CuPy or a CUDA device is missing (as in CI); the CPU side of
each check is in tests/backends/test_kernel_inputs.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import cupy_or_skip

pytestmark = pytest.mark.gpu

cupy = cupy_or_skip()

from test_kernel_inputs import BAD_LABELS, TORCH_NEGINF, _with_nans  # noqa: E402

from xpnn.backends import get_backend  # noqa: E402
from xpnn.nn.losses import LOSSES  # noqa: E402

DTYPES = ["float32", "float64"]


def _pair(dtype):
    return get_backend("numpy", dtype).kernels, get_backend("cupy", dtype).kernels


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [3, -1, 10**6])
def test_label_out_of_range_makes_its_row_nan_and_leaves_the_others(dtype, bad):
    host, dev = _pair(dtype)
    z = np.random.default_rng(0).standard_normal((3, 3)).astype(dtype)
    loss, grad = dev.softmax_cross_entropy(cupy.asarray(z), cupy.asarray([0, bad, 2]), 0.5)
    grad = cupy.asnumpy(grad)
    assert np.isnan(float(loss))
    assert np.isnan(grad[1]).all()
    _, want = host.softmax_cross_entropy(z, np.array([0, 1, 2]), 0.5)
    np.testing.assert_allclose(grad[[0, 2]], want[[0, 2]], rtol=1e-6)


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("labels, what", BAD_LABELS)
def test_losses_reject_labels_of_wrong_shape_or_dtype_on_the_device(loss, labels, what):
    _, dev = _pair("float64")
    with pytest.raises(ValueError, match=what):
        LOSSES[loss]()(dev, cupy.zeros((4, 3)), cupy.asarray(labels), 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_xent_with_a_minus_inf_logit_is_finite_on_the_device(dtype):
    _, dev = _pair(dtype)
    z = cupy.asarray([[-np.inf, 0.0, 1.0], [2.0, -np.inf, 1.0]], dtype=dtype)
    loss, grad = dev.softmax_cross_entropy(z, cupy.asarray([1, 0]), 1.0)
    grad = cupy.asnumpy(grad)
    assert float(loss) == pytest.approx(TORCH_NEGINF, rel=1e-6 if dtype == "float32" else 1e-12)
    assert np.all(np.isfinite(grad)) and grad[0, 0] == 0 and grad[1, 1] == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_relu_propagates_nan_on_the_device(dtype):
    host, dev = _pair(dtype)
    z = _with_nans((9, 11)).astype(dtype)
    b = np.random.default_rng(1).standard_normal(11).astype(dtype)
    b[3] = -50.0  # a NaN on a column that is otherwise all negative
    want = host.bias_act(z.copy(), b, "relu")
    got = cupy.asnumpy(dev.bias_act(cupy.asarray(z), cupy.asarray(b), "relu"))
    assert np.isnan(want).any()
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("size, stride", [(2, 2), (3, 3), (3, 2), (2, 1)])
def test_maxpool_propagates_nan_on_the_device(size, stride):
    host, dev = _pair("float64")
    x = np.random.default_rng(2).standard_normal((2, 3, 9, 10))
    x[0, 0, 0, 1] = np.nan  # not a window's first element
    x[0, 1, 4, 4] = np.nan
    x[1, 2, 5, 5] = x[1, 2, 5, 4] = np.nan  # two NaNs in one window: the first wins
    x[1, 0, 2, 3] = np.inf
    want_y, want_idx = host.maxpool2d_forward(x, size, stride)
    got_y, got_idx = dev.maxpool2d_forward(cupy.asarray(x), size, stride)
    assert np.isnan(want_y).sum() >= 3
    np.testing.assert_array_equal(cupy.asnumpy(got_y), want_y)
    np.testing.assert_array_equal(cupy.asnumpy(got_idx), want_idx)


def test_count_correct_rejects_a_column_of_labels_on_the_device():
    _, dev = _pair("float64")
    z = cupy.asarray([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0], [1.0, 0.0, 2.0], [0.0, 5.0, 0.0]])
    y = cupy.asarray([0, 1, 2, 0])
    assert int(dev.count_correct(z, y)) == 3
    with pytest.raises(ValueError, match=r"got shape \(4, 1\)"):
        dev.count_correct(z, y[:, None])
