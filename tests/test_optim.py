"""Optimizers against their textbook formulas; schedules and warmup."""

import math

import numpy as np
import pytest

from xpnn.backends import get_backend
from xpnn.backends.numba_kernels import PARALLEL_MIN_ELEMENTS
from xpnn.errors import UserError
from xpnn.optim import Schedule, make_optimizer


def _steps(name, backend_name="numpy", n=3):
    backend = get_backend(backend_name, "float64")
    p = np.array([1.0, -2.0, 0.5])
    g = np.zeros(3)
    opt = make_optimizer(name, p, g, backend.kernels, Schedule(0.1))
    history = []
    for t in range(n):
        g[...] = [0.5 * (t + 1), -1.0, 2.0]
        opt.step()
        history.append(p.copy())
    return history


def _reference(name, n=3):
    p = np.array([1.0, -2.0, 0.5])
    m = np.zeros(3)
    v = np.zeros(3)
    out = []
    for t in range(1, n + 1):
        g = np.array([0.5 * t, -1.0, 2.0])
        if name == "sgd":
            p = p - 0.1 * g
        elif name == "momentum":
            m = 0.9 * m + g
            p = p - 0.1 * m
        else:
            m = 0.9 * m + 0.1 * g
            v = 0.999 * v + 0.001 * g * g
            mhat, vhat = m / (1 - 0.9**t), v / (1 - 0.999**t)
            p = p - 0.1 * mhat / (np.sqrt(vhat) + 1e-8)
        out.append(p.copy())
    return out


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize("name", ["sgd", "momentum", "adam"])
def test_optimizer_matches_textbook(name, backend):
    for got, want in zip(_steps(name, backend), _reference(name), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12)


def test_warmup_is_linear_then_constant():
    s = Schedule(0.4, "constant", warmup_steps=4)
    assert [s(t) for t in range(6)] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.4, 0.4])


def test_step_and_cosine_schedules():
    s = Schedule(1.0, "step", step_size=2, gamma=0.5)
    assert [s(t) for t in range(5)] == [1.0, 1.0, 0.5, 0.5, 0.25]
    c = Schedule(1.0, "cosine", warmup_steps=2, total_steps=12)
    assert c(2) == pytest.approx(1.0) and c(7) == pytest.approx(0.5) and c(12) == pytest.approx(0)
    assert c(1) == pytest.approx(1.0) and c(0) == pytest.approx(0.5)
    assert all(c(t) >= c(t + 1) for t in range(2, 12))
    assert math.isclose(c(100), 0.0, abs_tol=1e-12)


def test_bad_optimizer_and_lr_are_user_errors():
    with pytest.raises(UserError, match="--optimizer"):
        make_optimizer("rmsprop", None, None, None, Schedule(0.1))
    with pytest.raises(UserError, match="--lr"):
        Schedule(-1.0)


@pytest.mark.parametrize("n", [1000, PARALLEL_MIN_ELEMENTS + 1000])  # serial, parallel loop
@pytest.mark.parametrize("name", ["sgd", "momentum", "adam"])
def test_gradient_rows_are_summed_as_the_update_reads_them(name, n):
    """A tuple of gradient buffers (one per rank sharing memory) updates like their sum."""
    rng = np.random.default_rng(3)
    rows = tuple(rng.standard_normal(n).astype(np.float32) for _ in range(3))
    results = []
    for backend_name, grads in (("numpy", rows[0] + rows[1] + rows[2]), ("numba", rows)):
        backend = get_backend(backend_name, "float32")
        p = np.linspace(-1, 1, n, dtype=np.float32)
        opt = make_optimizer(name, p, grads, backend.kernels, Schedule(0.01))
        opt.step()
        opt.step()
        results.append(p)
    np.testing.assert_allclose(results[1], results[0], rtol=2e-6, atol=1e-7)
    assert not np.allclose(results[1], np.linspace(-1, 1, n, dtype=np.float32))


@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("name", ["sgd", "momentum", "adam"])
def test_numpy_chunked_updates_give_the_bits_of_the_whole_buffer_formula(name, rows):
    """NumPy's updates run a chunk at a time (``HostKernels``); over several chunks and a ragged
    last one, with gradient rows summed as they are read, every value matches the array-API
    formula over whole buffers exactly."""
    from xpnn.backends.kernels import HostKernels, Kernels

    n = 2 * HostKernels.CHUNK + 123
    rng = np.random.default_rng(7)
    grads = tuple(rng.standard_normal(n).astype(np.float32) for _ in range(rows))
    grads = grads if rows > 1 else grads[0]
    results = []
    for kernels in (Kernels(np), HostKernels(np)):
        p = np.linspace(-1, 1, n, dtype=np.float32)
        opt = make_optimizer(name, p, grads, kernels, Schedule(0.01))
        for _ in range(3):
            opt.step()
        results.append((p, *opt.state.values()))
    assert not np.allclose(results[1][0], np.linspace(-1, 1, n, dtype=np.float32))
    for whole, chunked in zip(*results, strict=True):
        np.testing.assert_array_equal(chunked, whole)
