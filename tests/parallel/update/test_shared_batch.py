"""The pieces of sharing activations on a node: gradient shares, the choice of scheme, where
each rank's samples go. (The whole scheme under mpiexec: test_data_parallel.py.)"""

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xpnn.backends import get_backend
from xpnn.errors import UserError
from xpnn.nn import build_model
from xpnn.nn.dense import Dense
from xpnn.nn.layer import Context
from xpnn.parallel.comm.shm import ALIGN, share_bounds
from xpnn.parallel.model.shared import (
    Placement,
    SharedDense,
    backward_units,
    forward_units,
    grads_of_rows,
    input_grad_rows,
    row_align,
    splits_units,
)
from xpnn.parallel.update.node_shared import activation_values, shares_activations


@settings(deadline=None, max_examples=40)
@given(st.integers(1, 40), st.integers(1, 40), st.integers(0, 9), st.integers(1, 4))
def test_shares_of_the_gradient_make_the_whole_gradient(fan_in, units, batch, parts):
    """Each rank's rows of W and share of b, computed from the whole batch's x and dz, are the
    rows of the gradient that backward assigns whole (an empty batch: zeros)."""
    backend = get_backend("numpy", "float64")
    layer = Dense(units, "relu")
    layer.build((fan_in,), backend, np.random.default_rng(0))
    rng = np.random.default_rng(1)
    layer.params = {name: rng.standard_normal(shape) for name, (_, shape) in layer.initial.items()}
    layer.grads = {name: np.full_like(p, np.nan) for name, p in layer.params.items()}
    x, dy = rng.standard_normal((batch, fan_in)), rng.standard_normal((batch, units))
    layer.forward(x, Context(train=True))
    layer.backward(dy)
    whole = {name: g.copy() for name, g in layer.grads.items()}
    dz, _ = backend.kernels.bias_act_backward(dy, layer.y, "relu")
    for name in layer.grads:
        layer.grads[name][...] = np.nan
    for i in range(parts):
        rows = slice(*share_bounds(0, fan_in, parts, i))
        cols = slice(*share_bounds(0, units, parts, i))
        grads_of_rows(layer, x, dz, rows, cols)
    for name in whole:
        np.testing.assert_allclose(layer.grads[name], whole[name], rtol=1e-12, atol=1e-12)


@settings(deadline=None, max_examples=30)
@given(
    st.integers(1, 40),
    st.integers(1, 40),
    st.integers(0, 9),
    st.integers(1, 4),
    st.sampled_from(["numpy", "numba"]),
    st.sampled_from(["relu", "tanh", "sigmoid", "identity"]),
)
def test_units_slices_make_the_whole_pass(fan_in, units, batch, parts, backend_name, act):
    """The output, ``dz``, bias gradient and ``dx`` that ranks splitting a layer's units
    write slice by slice into shared arrays (strided column blocks of them) are those of
    the whole layer's forward and backward."""
    backend = get_backend(backend_name, "float64")
    layer = Dense(units, act)
    layer.build((fan_in,), backend, np.random.default_rng(0))
    rng = np.random.default_rng(1)
    layer.params = {name: rng.standard_normal(shape) for name, (_, shape) in layer.initial.items()}
    layer.grads = {name: np.full_like(p, np.nan) for name, p in layer.params.items()}
    x, dy = rng.standard_normal((batch, fan_in)), rng.standard_normal((batch, units))
    y_whole = layer.forward(x, Context(train=True)).copy()
    dx_whole = layer.backward(dy.copy())
    db_whole = layer.grads["b"].copy()
    y, dz, dx = np.full_like(y_whole, np.nan), dy.copy(), np.full_like(x, np.nan)
    layer.grads["b"][...] = np.nan
    for i in range(parts):
        cols = slice(*share_bounds(0, units, parts, i))
        forward_units(layer, x, cols, y[:, cols])
        backward_units(layer, dz[:, cols], y[:, cols], cols)
    for i in range(parts):  # every unit's dz is in: each part's inputs
        rows = slice(*share_bounds(0, fan_in, parts, i))
        input_grad_rows(layer, dz, rows, dx[:, rows])
    np.testing.assert_allclose(y, y_whole, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(layer.grads["b"], db_whole, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dx, dx_whole, rtol=1e-12, atol=1e-12)


def test_wide_layers_split_by_units_narrow_ones_by_samples():
    """A rank gets a cache line of every row of a layer it splits by units, or none of it."""
    assert splits_units(ALIGN * 2, 2) and splits_units(1024, 2)
    assert not splits_units(ALIGN * 2 - 1, 2) and not splits_units(10, 2)
    assert splits_units(ALIGN * 3, 3) and not splits_units(ALIGN * 3 - 1, 3)


def test_backward_sharing_the_batch_hands_over_x_and_dz_and_assigns_nothing():
    """A node of one rank whose shared arrays are plain arrays: the layer's samples land in
    them, and the gradients are left for the shares to assign."""
    backend = get_backend("numpy", "float64")
    dense = Dense(3, "tanh")
    dense.build((4,), backend, np.random.default_rng(0))
    rng = np.random.default_rng(2)
    dense.params = {name: rng.standard_normal(shape) for name, (_, shape) in dense.initial.items()}
    dense.grads = {name: np.full_like(p, 7.0) for name, p in dense.params.items()}
    node = SimpleNamespace(shared_zeros=np.zeros, fence=lambda: None, local_rank=0, local_size=1)
    place = Placement([0], 1, 0)
    place.begin(5)
    layer = SharedDense(dense, node, 5, place, None)
    x, dy = rng.standard_normal((5, 4)), rng.standard_normal((5, 3))
    layer.forward(x, Context(train=True))
    dx = layer.backward(dy)
    x_put, dz_put = layer.node_x, layer.node_dz
    np.testing.assert_array_equal(x_put, x)
    np.testing.assert_allclose(dz_put, dy * (1 - layer.y**2))
    np.testing.assert_allclose(dx, dz_put @ layer.params["W"].T)
    assert all((g == 7.0).all() for g in layer.grads.values())  # left for the shares
    assert layer.params is dense.params and layer.grads is dense.grads  # the same views


def _model(name, hidden=(1024, 1024)):
    shape = (1, 28, 28)
    return build_model(name, hidden).build(shape, get_backend("numpy", "float32"), 0)


def test_auto_shares_whichever_is_smaller():
    mlp = _model("mlp")
    # 784-1024-1024-10: x and dz of the three layers, 128 x 4,890 = 0.63 M values
    assert activation_values(mlp, 128) == 128 * (784 + 1024 + 1024 + 1024 + 1024 + 10)
    assert shares_activations(mlp, 128, "auto")  # < the 1.86 M values of a gradient row
    assert shares_activations(mlp, 381, "auto")
    assert not shares_activations(mlp, 382, "auto")  # 1.868 M: more than a row
    assert not shares_activations(mlp, 60_000, "auto")  # full batch: gradients
    assert shares_activations(mlp, 60_000, "activations")  # as asked
    assert not shares_activations(mlp, 128, "gradients")


def test_only_dense_models_share_activations():
    cnn = _model("cnn")
    assert not shares_activations(cnn, 1, "auto")
    assert not shares_activations(cnn, 1, "gradients")
    with pytest.raises(UserError, match="`node_share` activations: .* this one has Conv2D"):
        shares_activations(cnn, 1, "activations")


@pytest.mark.parametrize(("units", "align"), [(1024, 1), (10, 8), (12, 4), (7, 16)])
def test_row_shares_start_on_cache_lines_and_split_evenly(units, align):
    assert row_align(units) == align
    cuts = [share_bounds(0, 784, 2, i, row_align(units)) for i in range(2)]
    assert cuts[0][1] == cuts[1][0] and (cuts[0][1] * units) % ALIGN == 0
    assert abs((cuts[0][1] - cuts[0][0]) - (cuts[1][1] - cuts[1][0])) <= 2 * align
    if units == 1024:
        assert cuts == [(0, 392), (392, 784)]


@pytest.mark.parametrize(
    ("data_ranks", "size", "batch", "expected"),
    [
        ([0, 1], 2, 128, [(0, 64), (64, 128)]),
        ([0, 1, 2], 3, 2, [(0, 1), (1, 2), (2, 2)]),  # the last rank has no sample
        ([2, 3], 4, 10, [(0, 2), (2, 4)]),  # the second node of two: ranks 2, 3 of 4
        ([1, 3], 4, 10, [(0, 3), (3, 5)]),  # a node's ranks need not be consecutive
    ],
)
def test_each_rank_writes_its_samples_after_the_node_ranks_before_it(
    data_ranks, size, batch, expected
):
    for me, (lo, hi) in enumerate(expected):
        place = Placement(data_ranks, size, me)
        place.begin(batch)
        assert (place.lo, place.hi, place.total) == (lo, hi, expected[-1][1])
