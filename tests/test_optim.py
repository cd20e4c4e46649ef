"""Optimizers against their textbook formulas; schedules and warmup."""

import math

import numpy as np
import pytest

from xpnn.backends import get_backend
from xpnn.backends.numba_jit import PARALLEL_MIN_ELEMENTS
from xpnn.errors import UserError
from xpnn.train.optim import Schedule, make_optimizer


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
    with pytest.raises(UserError, match="`optimizer`"):
        make_optimizer("rmsprop", None, None, None, Schedule(0.1))
    with pytest.raises(UserError, match="`lr`"):
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
    """NumPy's updates run a chunk at a time (``NumpyKernels``); over several chunks and a ragged
    last one, with gradient rows summed as they are read, every value matches the array-API
    formula over whole buffers exactly."""
    from xpnn.backends.kernels import Kernels
    from xpnn.backends.numpy_kernels import NumpyKernels

    n = 2 * NumpyKernels.CHUNK + 123
    rng = np.random.default_rng(7)
    grads = tuple(rng.standard_normal(n).astype(np.float32) for _ in range(rows))
    grads = grads if rows > 1 else grads[0]
    results = []
    for kernels in (Kernels(np), NumpyKernels(np)):
        p = np.linspace(-1, 1, n, dtype=np.float32)
        opt = make_optimizer(name, p, grads, kernels, Schedule(0.01))
        for _ in range(3):
            opt.step()
        results.append((p, *opt.state.values()))
    assert not np.allclose(results[1][0], np.linspace(-1, 1, n, dtype=np.float32))
    for whole, chunked in zip(*results, strict=True):
        np.testing.assert_array_equal(chunked, whole)


def _decayed_state(dtype, n=4000):
    """Moments as a long run leaves them: half the gradients 0 (dead units), their moments
    decayed into and through the subnormal range; one NaN and one infinity."""
    tiny = np.finfo(dtype).smallest_normal
    rng = np.random.default_rng(11)
    g = rng.standard_normal(n).astype(dtype)
    g[: n // 2] = 0
    g[n // 2 : n // 2 + 50] *= np.sqrt(tiny) / 4  # their squares would be subnormal
    state = (rng.random(n) * tiny * 4).astype(dtype)  # around the smallest normal number
    state[-100:] = rng.random(100).astype(dtype)
    state[0], state[1] = np.nan, np.inf
    return g, state


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", ["momentum", "adam"])
@pytest.mark.parametrize("kernels", ["reference", "numpy", "numba"])
def test_optimizer_state_never_holds_subnormal_values(kernels, name, dtype):
    """A moment whose gradient is 0 decays through the subnormal range, where each operation
    on it takes a CPU's slow path: epochs 2 and 3 of the MLP 784-1024-1024-10 were 20 % and
    50 % slower than the first. Every backend's state is now zero there instead (and NaN and
    infinity stay), and the other values are what the textbook formula gives."""
    from xpnn.backends.kernels import Kernels

    tiny = np.finfo(dtype).smallest_normal
    g, state = _decayed_state(dtype)
    k = (
        Kernels(np)
        if kernels == "reference"
        else get_backend(kernels, np.dtype(dtype).name).kernels
    )
    p = np.ones_like(g)
    opt = make_optimizer(name, p, g, k, Schedule(1e-3))
    for value in opt.state.values():
        value[...] = state
    with np.errstate(invalid="ignore"):  # inf / inf in the NaN and infinity's updates
        opt.step()
    first = opt.state["velocity" if name == "momentum" else "m"]
    for value in opt.state.values():
        finite = value[2:]
        assert not np.any((finite != 0) & (np.abs(finite) < tiny)), "a subnormal was kept"
        assert np.isnan(value[0]) and np.isinf(value[1])
    decayed = state[2 : len(g) // 2] * dtype(0.9)  # gradient 0: the moment decays by 0.9
    expect = np.where(decayed < tiny, 0, decayed)
    assert np.count_nonzero(expect == 0) > 100 and np.count_nonzero(expect) > 100
    np.testing.assert_allclose(first[2 : len(g) // 2], expect, rtol=1e-6)
    assert np.isfinite(p[2:]).all() and not np.array_equal(p[2:], np.ones_like(p[2:]))


def test_step_hooks_run_around_an_applied_step_and_a_skip_rule_skips_one():
    """A skip rule hears every step; a skipped step moves nothing, counts nothing and runs no
    hook; an applied one runs the pre-step hooks before its update, the post-step ones after."""
    backend = get_backend("numpy", "float64")
    p, g = np.array([1.0, -2.0, 0.5]), np.array([1.0, 1.0, 1.0])
    opt = make_optimizer("sgd", p, g, backend.kernels, Schedule(0.1))
    events, verdicts = [], iter([False, True, False])

    def skip(o):
        events.append(("rule", o.step_count))
        return next(verdicts)

    opt.add_skip_rule(skip)
    opt.add_pre_step_hook(lambda o: events.append(("pre", o.step_count, p[0])))
    opt.add_post_step_hook(lambda o: events.append(("post", o.step_count, p[0])))
    moved = []
    for _ in range(3):
        opt.step()
        moved.append(p[0])
    assert moved == [0.9, 0.9, pytest.approx(0.8)]
    assert opt.step_count == 2
    assert events == [
        ("rule", 0), ("pre", 0, 1.0), ("post", 1, 0.9),
        ("rule", 1),
        ("rule", 1), ("pre", 1, 0.9), ("post", 2, pytest.approx(0.8)),
    ]  # fmt: skip
