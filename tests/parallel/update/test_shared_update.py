"""The pieces of the shared-memory update: shares, layer buckets, sharded optimizers over
summed rows, adopted buffers."""

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from xpnn.backends import get_backend
from xpnn.nn import build_model
from xpnn.nn.layer import Context
from xpnn.parallel.comm.shm import ALIGN, share_bounds
from xpnn.parallel.update.base import MIN_LAYER_BUCKET, layer_buckets
from xpnn.train.optim import Schedule, make_optimizer


@given(st.integers(0, 3000), st.integers(0, 3000), st.integers(1, 9))
def test_share_bounds_cut_a_range_into_aligned_disjoint_slices(start, length, parts):
    end = start + length
    bounds = [share_bounds(start, end, parts, i) for i in range(parts)]
    covered = np.zeros(end, dtype=int)
    for lo, hi in bounds:
        assert start <= lo <= hi <= end
        assert lo % ALIGN == 0 or lo in (start, end)  # inner cuts fall on cache lines
        covered[lo:hi] += 1
    assert (covered[start:] == 1).all() and (covered[:start] == 0).all()


def test_share_bounds_are_near_equal_for_large_ranges():
    sizes = [hi - lo for lo, hi in (share_bounds(5, 1_000_008, 3, i) for i in range(3))]
    assert sum(sizes) == 1_000_003 and max(sizes) - min(sizes) <= 2 * ALIGN


@given(st.lists(st.integers(0, 500), max_size=8), st.integers(1, 500), st.integers(1, 200))
def test_layer_buckets_cut_at_layer_starts_from_the_end(offsets, n, min_size):
    bounds = layer_buckets(offsets, n, min_size)
    assert bounds[0][1] == n and bounds[-1][0] == 0  # last range first, down to the start
    for (lo, hi), (_, next_hi) in zip(bounds, bounds[1:] + [(0, 0)], strict=True):
        assert lo < hi and (lo == 0 or lo in offsets)
        assert next_hi == lo or next_hi == 0  # contiguous
        assert hi - lo >= min_size or lo == 0


def test_mlp_layers_make_two_buckets():
    # 784-1024-1024-10: the small last layer rides with the second; the first stands alone
    offsets = [0, 0, 784 * 1024 + 1024, 784 * 1024 + 1024 + 1024 * 1024 + 1024]
    n = offsets[-1] + 1024 * 10 + 10
    assert layer_buckets(offsets, n, MIN_LAYER_BUCKET) == [(offsets[2], n), (0, offsets[2])]


def _state_after(name, parts, rows=1, steps=3, n=1000, backend_name="numpy"):
    """Parameters and state after ``steps`` updates split over one optimizer per entry of
    ``parts`` (each a list of slices), with the gradient given as ``rows`` summed buffers."""
    backend = get_backend(backend_name, "float64")
    rng = np.random.default_rng(0)
    params, grads = rng.standard_normal(n), np.empty((rows, n))
    buffers, calls = [], itertools.count()
    per_optimizer = {"sgd": 0, "momentum": 1, "adam": 2}[name]

    def zeros(shape, dtype):  # each optimizer asks for its state in order: hand out the same
        i = next(calls) % per_optimizer
        if i == len(buffers):
            buffers.append(np.zeros(shape, dtype))
        return buffers[i]

    given = tuple(grads) if rows > 1 else grads[0]
    opts = [
        make_optimizer(name, params, given, backend.kernels, Schedule(0.01), own, zeros)
        for own in parts
    ]
    for step in range(steps):
        total = np.random.default_rng(step + 1).standard_normal(n)
        grads[...] = total / rows  # rows summing to the same gradient whatever their number
        for opt in opts:
            opt.step()
    return params, opts[0].state


@pytest.mark.parametrize("backend_name", ["numpy", "numba"])
def test_sharded_optimizers_with_summed_rows_equal_one_whole_optimizer(backend_name):
    quarters = [slice(0, 250), slice(250, 500), slice(500, 750), slice(750, 1000)]
    for name in ("sgd", "momentum", "adam"):
        whole, whole_state = _state_after(name, [None], backend_name=backend_name)
        split, split_state = _state_after(
            name,
            [[quarters[3], quarters[1]], [quarters[2], quarters[0]]],
            rows=2,
            backend_name=backend_name,
        )
        np.testing.assert_allclose(split, whole, rtol=1e-14, err_msg=name)
        for key in whole_state:
            np.testing.assert_allclose(split_state[key], whole_state[key], rtol=1e-13)
        assert not np.allclose(whole, _state_after(name, [None], steps=0)[0])  # it did move


def test_update_part_moves_only_its_part_at_the_steps_rate():
    backend = get_backend("numpy", "float64")
    p, g = np.ones(4), np.ones(4)
    opt = make_optimizer("sgd", p, g, backend.kernels, Schedule(0.5), [slice(0, 2), slice(2, 4)])
    assert opt.start_step() == 0.5
    opt.update_part(1)
    np.testing.assert_array_equal(p, [1, 1, 0.5, 0.5])  # only the part asked for moved


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
