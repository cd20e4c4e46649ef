"""The pieces of the shared-memory update: slices, sharded optimizers, adopted buffers."""

import itertools

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from xpnn.backends import get_backend
from xpnn.nn import build_model
from xpnn.nn.layer import Context
from xpnn.optim import Schedule, make_optimizer
from xpnn.parallel.shared_update import ALIGN, shard_bounds


@given(st.integers(0, 5000), st.integers(1, 9))
def test_shard_bounds_cut_the_buffer_into_aligned_disjoint_slices(n, parts):
    bounds = [shard_bounds(n, parts, i) for i in range(parts)]
    covered = np.zeros(n, dtype=int)
    for lo, hi in bounds:
        assert 0 <= lo <= hi <= n
        assert lo % ALIGN == 0 or lo == n
        covered[lo:hi] += 1
    assert (covered == 1).all()
    assert max(hi - lo for lo, hi in bounds) - min(hi - lo for lo, hi in bounds) <= n or n == 0


def test_shard_bounds_are_near_equal_for_large_buffers():
    sizes = [hi - lo for lo, hi in (shard_bounds(1_000_003, 3, i) for i in range(3))]
    assert sum(sizes) == 1_000_003 and max(sizes) - min(sizes) <= 2 * ALIGN


def _state_after(name, shards, steps=3, n=1000):
    """Parameters and state after ``steps`` updates split over ``shards`` optimizers."""
    backend = get_backend("numpy", "float64")
    rng = np.random.default_rng(0)
    params, grads = rng.standard_normal(n), np.empty(n)
    buffers, calls = [], itertools.count()
    per_optimizer = {"sgd": 0, "momentum": 1, "adam": 2}[name]

    def zeros(shape, dtype):  # each optimizer asks for its state in order: hand out the same
        i = next(calls) % per_optimizer
        if i == len(buffers):
            buffers.append(np.zeros(shape, dtype))
        return buffers[i]

    bounds = [shard_bounds(n, shards, i) for i in range(shards)]
    opts = [
        make_optimizer(name, params, grads, backend.kernels, Schedule(0.01), slice(*b), zeros)
        for b in bounds
    ]
    for step in range(steps):
        grads[...] = np.random.default_rng(step + 1).standard_normal(n)
        for opt in opts:
            opt.step()
    return params, opts[0].state


def test_sharded_optimizers_equal_one_whole_optimizer():
    for name in ("sgd", "momentum", "adam"):
        whole, whole_state = _state_after(name, 1)
        split, split_state = _state_after(name, 3)
        np.testing.assert_array_equal(split, whole, err_msg=name)
        for key in whole_state:
            np.testing.assert_array_equal(split_state[key], whole_state[key], err_msg=name)
        assert not np.allclose(whole, _state_after(name, 1, steps=0)[0])  # it did move


def test_adopt_moves_parameters_and_gradients_into_new_buffers():
    backend = get_backend("numpy", "float64")
    model = build_model("mlp", (6,), "relu", 3, "softmax_cross_entropy").build((4,), backend, 0)
    before = model.params.copy()
    params, grads = np.full(model.size, np.nan), np.full(model.size, np.nan)
    model.adopt(params, grads)
    assert model.params is params and model.grads is grads
    np.testing.assert_array_equal(params, before)
    x = np.random.default_rng(1).standard_normal((5, 4))
    y = np.array([0, 1, 2, 0, 1])
    model.loss_and_grads(x, y, Context(train=True), 1 / 5)
    assert np.isfinite(grads).all()  # backward wrote every gradient into the adopted buffer
    params[:] = 0
    logits = model.forward(x, Context(train=False))
    assert np.allclose(logits, 0)  # the layers read the adopted parameters
    untouched = np.full(model.size, 7.0)
    model.adopt(untouched, grads, copy=False)
    assert (untouched == 7.0).all()
