"""Updates in parts give the same run as one update after backward: one process updates each
bucket of layers during backward; ``AllreduceUpdate`` updates each part as its buckets arrive."""

import numpy as np
import pytest

from xpnn.backends import get_backend
from xpnn.nn import build_model
from xpnn.nn.layer import Context
from xpnn.parallel.comm import SelfCommunicator
from xpnn.parallel.update.base import MIN_LAYER_BUCKET, AllreduceUpdate, LocalUpdate
from xpnn.train.optim import Schedule, make_optimizer

IN, HIDDEN = 260, (256, 256)  # first and second Dense are each a bucket (>= 65,536 values)


def _model(backend):
    model = build_model("mlp", HIDDEN, "relu", 10, "softmax_cross_entropy")
    return model.build((IN,), backend, 0)


def _batches(steps=3, size=32):
    rng = np.random.default_rng(5)
    return [(rng.standard_normal((size, IN)), rng.integers(0, 10, size)) for _ in range(steps)]


def _maker(backend, optimizer):
    """The ``make_optimizer`` callback an update scheme is built with."""

    def make(params, grads, parts=None, zeros=None):
        return make_optimizer(optimizer, params, grads, backend.kernels, Schedule(0.01), parts)

    return make


def _assert_same_run_as_one_update(update, model, whole, make):
    """Three steps updated by ``update`` during and after backward leave ``model`` where one
    optimizer step after each whole backward pass leaves ``whole``, bit for bit."""
    reference = make(whole.params, whole.grads)
    for step, (x, y) in enumerate(_batches()):
        ctx = Context(train=True, step=step)
        model.loss_and_grads(x, y, ctx, 1 / len(x), update.grads_ready)
        update.finish()
        whole.loss_and_grads(x, y, ctx, 1 / len(x))
        reference.step()
    np.testing.assert_array_equal(model.params, whole.params)
    assert reference.step_count == update.optimizer.step_count == 3


@pytest.mark.parametrize("backend_name", ["numpy", "numba"])
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
def test_layerwise_update_equals_one_update_after_backward(backend_name, optimizer):
    backend = get_backend(backend_name, "float64")
    make = _maker(backend, optimizer)
    layerwise, whole = _model(backend), _model(backend)
    update = LocalUpdate(layerwise, SelfCommunicator(), make)
    assert len(update.optimizer.parts) == 2
    _assert_same_run_as_one_update(update, layerwise, whole, make)


def test_last_layers_are_updated_before_the_first_layer_runs_backward():
    backend = get_backend("numpy", "float64")
    model = _model(backend)
    update = LocalUpdate(model, SelfCommunicator(), _maker(backend, "sgd"))
    events = []
    first_dense = next(layer for layer in model.layers if layer.initial)
    backward = first_dense.backward
    first_dense.backward = lambda *a, **k: (events.append("first backward"), backward(*a, **k))[1]
    update_part = update.optimizer.update_part
    update.optimizer.update_part = lambda i: (events.append(f"update {i}"), update_part(i))[1]
    x, y = _batches(1)[0]
    model.loss_and_grads(x, y, Context(train=True), 1 / len(x), update.grads_ready)
    update.finish()
    assert events == ["update 0", "first backward", "update 1"]


@pytest.mark.parametrize("bucket_bytes", [10_000, 100 << 20])
def test_allreduce_update_goes_part_by_part_in_whole_buckets(bucket_bytes):
    """Parts are runs of whole buckets of >= MIN_LAYER_BUCKET values (the one at the start of
    the buffer takes what is left), each waited for up to its first bucket; the run is the
    same, bit for bit, as one update after backward."""
    backend = get_backend("numba", "float64")
    make = _maker(backend, "adam")
    parted, whole = _model(backend), _model(backend)
    update = AllreduceUpdate(parted, SelfCommunicator(), make, bucket_bytes)
    parts, bounds = update.optimizer.parts, update.buckets.bounds
    assert parts[0].stop == parted.size and parts[-1].start == 0
    assert all(a.start == b.stop for a, b in zip(parts[:-1], parts[1:], strict=True))
    assert all(p.stop - p.start >= MIN_LAYER_BUCKET for p in parts[:-1])
    assert [bounds[k - 1][0] for k in update.waits] == [p.start for p in parts]
    assert update.waits[-1] == len(bounds)
    if bucket_bytes == 10_000:  # 109 buckets of 1,250 values: parts of 53, 53 and 3 buckets
        assert len(bounds) == 109 and len(parts) == 3
    else:
        assert len(bounds) == len(parts) == 1
    _assert_same_run_as_one_update(update, parted, whole, make)
