"""How the Numba kernels are built: serial and parallel twins agree, NumPy's error model.

``numba_kernels`` compiles each kernel twice (``Twin``) and dispatches to the ``prange``
build only for arrays of at least ``PARALLEL_MIN_ELEMENTS`` (2**19) values. Every other test
uses small arrays, so without this file the parallel builds would run almost never. Here
each build is called directly on identical inputs (fresh copies: the kernels write in place)
of odd shapes, which no thread count divides evenly, and the outputs are compared.

Tolerances: every output is computed by the same per-element (or per-row, per-chunk)
arithmetic in both builds, with no fast-math, so it is bit-identical and compared exactly.
The one exception is the loss of ``_softmax_xent``: a ``prange`` reduction whose partial
sums the parallel build adds per thread, in another order than the serial loop.
"""

import numba as nb
import numpy as np
import pytest

from xpnn.backends import get_backend
from xpnn.backends import numba_kernels as nk
from xpnn.backends import numba_seq as seq
from xpnn.backends.kernels import Kernels
from xpnn.backends.numba_jit import ACT_CODE, PARALLEL_MIN_ELEMENTS, Twin

TWINS = {name: obj for name, obj in vars(nk).items() if isinstance(obj, Twin)}
DTYPES = [np.float32, np.float64]
ROWS, COLS = 37, 53  # prime: no thread count splits them evenly
SIZE = ROWS * COLS
CASES = {
    "_bias_act",
    "_bias_act_backward",
    "_bias_gelu_backward_f32",
    "_column_sums",
    "_softmax_xent",
    "_sum_rows",
    "_sgd",
    "_momentum",
    "_adam",
    "_gelu_backward",
    "_layer_norm",
    "_layer_norm_input_grad",
}


def _fresh(args):
    """A copy of every array in ``args``, inside tuples too; scalars as they are."""
    out = []
    for a in args:
        if isinstance(a, np.ndarray):
            out.append(a.copy())
        elif isinstance(a, tuple):
            out.append(tuple(x.copy() for x in a))
        else:
            out.append(a)
    return out


def _both(name, args):
    """Run the serial and the parallel build of twin ``name`` on copies of ``args``; return
    (result, arguments after the call) for each."""
    twin = TWINS[name]
    runs = []
    for build in (twin.serial, twin.parallel):
        fresh = _fresh(args)
        runs.append((build(*fresh), fresh))
    return runs


def _assert_same_arrays(a, b):
    """The arrays in two argument lists are bit-identical (in-place outputs included)."""
    for x, y in zip(a, b, strict=True):
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y)


def _every_kernel() -> list:
    """(name, dispatcher) of every compiled Numba kernel: both builds of each twin, and the
    plain jits of the convolution module."""
    import numba

    from xpnn.backends import numba_conv

    found = [(name, build) for name, t in TWINS.items() for build in (t.serial, t.parallel)]
    for name, obj in vars(numba_conv).items():
        if isinstance(obj, numba.core.registry.CPUDispatcher):
            found.append((name, obj))
    return found


def test_every_numba_kernel_uses_numpys_error_model():
    """Python's error model checks each float division for a zero divisor, and that branch
    stops LLVM vectorising the loop (serial Adam 10x slower); no kernel may fall back to it."""
    kernels = _every_kernel()
    assert len(kernels) > 20
    slow = [name for name, k in kernels if k.targetoptions.get("error_model") != "numpy"]
    assert not slow, f"kernels compiled with Python's error model: {slow}"


@pytest.mark.parametrize("build", ["serial", "parallel"])
def test_adam_divides_by_zero_like_numpy(build):
    """0 / 0 in the update gives nan, as NumPy does, on both builds; no ZeroDivisionError."""
    f32 = np.float32
    p, g, m, v = np.ones(8, f32), np.zeros(8, f32), np.zeros(8, f32), np.zeros(8, f32)
    lr, b1, b2, eps = f32(1e-3), f32(0.9), f32(0.999), f32(0.0)
    tiny = np.finfo(f32).smallest_normal
    scalars = (lr, b1, b2, f32(1) - b1, f32(1) - b2, eps, f32(1), f32(1), tiny)
    getattr(nk._adam, build)(p, g, m, v, *scalars)
    assert np.isnan(p).all()


def test_every_twin_has_a_case():
    """A new twin in numba_kernels must get a case here."""
    assert set(TWINS) == CASES


@pytest.mark.parametrize("act", sorted(ACT_CODE))
@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_act(dtype, act):
    """Elementwise bias + activation: exact."""
    rng = np.random.default_rng(1)
    z = (rng.standard_normal((ROWS, COLS)) * 4).astype(dtype)
    z[0, :5] = 0  # relu's and sigmoid's branch points
    b = rng.standard_normal(COLS).astype(dtype)
    (out_s, args_s), (out_p, args_p) = _both("_bias_act", (z, b, ACT_CODE[act]))
    np.testing.assert_array_equal(out_p, out_s)
    _assert_same_arrays(args_s, args_p)


@pytest.mark.parametrize("chunks", [1, 2, 5, ROWS])
@pytest.mark.parametrize("act", sorted(ACT_CODE))
@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_act_backward(dtype, act, chunks):
    """dz is elementwise and db adds per-chunk partial sums in chunk order in both builds
    (the chunking is an argument, not the thread team), so both are exact."""
    rng = np.random.default_rng(2)
    dy = rng.standard_normal((ROWS, COLS)).astype(dtype)
    y = rng.standard_normal((ROWS, COLS)).astype(dtype)
    if act == "relu":
        y = np.maximum(y, 0)
    elif act == "sigmoid":
        y = 1 / (1 + np.exp(-y))
    elif act == "tanh":
        y = np.tanh(y)
    args = (dy, y, ACT_CODE[act], chunks)
    ((dz_s, db_s), args_s), ((dz_p, db_p), args_p) = _both("_bias_act_backward", args)
    assert db_p.dtype == dtype
    np.testing.assert_array_equal(dz_p, dz_s)
    np.testing.assert_array_equal(db_p, db_s)
    _assert_same_arrays(args_s, args_p)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_xent(dtype):
    """The gradient is per row: exact. The loss is a prange reduction, summed in another
    order by the parallel build. Its accumulator is float64 for both dtypes (``loss = 0.0``)
    and every row's term is >= 0, so any order stays within (ROWS - 1) * 2**-53 ~ 4e-15 of
    the exact sum: rtol=1e-12 has a wide margin and would still catch a lost or doubled row."""
    rng = np.random.default_rng(3)
    z = (rng.standard_normal((ROWS, COLS)) * 5).astype(dtype)
    labels = rng.integers(0, COLS, size=ROWS, dtype=np.int64)
    args = (z, labels, dtype(1 / ROWS))
    ((loss_s, grad_s), args_s), ((loss_p, grad_p), args_p) = _both("_softmax_xent", args)
    assert isinstance(loss_s, float) and isinstance(loss_p, float)
    assert grad_p.dtype == dtype
    np.testing.assert_array_equal(grad_p, grad_s)
    np.testing.assert_allclose(loss_p, loss_s, rtol=1e-12, atol=0)
    _assert_same_arrays(args_s, args_p)


def _grads(rng, dtype, n_grads, size=SIZE):
    """A tuple of ``n_grads`` gradient rows, as ``_sum_rows`` takes them."""
    return tuple(rng.standard_normal(size).astype(dtype) for _ in range(n_grads))


@pytest.mark.parametrize("n_grads", [1, 2, 3])  # one rank, ranks sharing memory
@pytest.mark.parametrize("dtype", DTYPES)
def test_sum_rows(dtype, n_grads):
    """Elementwise sum of the rows, in row order: exact, and NumPy's sum in that order."""
    rng = np.random.default_rng(8)
    rows = _grads(rng, dtype, n_grads)
    (out_s, args_s), (out_p, args_p) = _both("_sum_rows", (np.empty(SIZE, dtype), rows))
    want = rows[0].copy()
    for row in rows[1:]:
        want += row
    np.testing.assert_array_equal(out_s, want)
    np.testing.assert_array_equal(out_p, want)
    _assert_same_arrays(args_s, args_p)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sgd(dtype):
    """Elementwise update of p: exact."""
    rng = np.random.default_rng(4)
    p = rng.standard_normal(SIZE).astype(dtype)
    args = (p, rng.standard_normal(SIZE).astype(dtype), dtype(0.05))
    (out_s, args_s), (out_p, args_p) = _both("_sgd", args)
    assert out_s is None and out_p is None
    assert not np.array_equal(args_s[0], p)
    _assert_same_arrays(args_s, args_p)


@pytest.mark.parametrize("dtype", DTYPES)
def test_momentum(dtype):
    """Elementwise update of p and v: exact."""
    rng = np.random.default_rng(5)
    p = rng.standard_normal(SIZE).astype(dtype)
    v = rng.standard_normal(SIZE).astype(dtype)
    tiny = np.finfo(dtype).smallest_normal
    args = (p, rng.standard_normal(SIZE).astype(dtype), v, dtype(0.05), dtype(0.9), tiny)
    (_, args_s), (_, args_p) = _both("_momentum", args)
    assert not np.array_equal(args_s[0], p) and not np.array_equal(args_s[2], v)
    _assert_same_arrays(args_s, args_p)


@pytest.mark.parametrize("dtype", DTYPES)
def test_adam(dtype):
    """Elementwise update of p, m and v: exact. Scalars built as NumbaKernels.adam_update
    builds them (step 3, AdamW's decay of 0.99), in the arrays' dtype."""
    rng = np.random.default_rng(6)
    p = rng.standard_normal(SIZE).astype(dtype)
    m = (rng.standard_normal(SIZE) * 0.1).astype(dtype)
    v = (rng.random(SIZE) * 0.01).astype(dtype)
    lr, beta1, beta2, eps, step = 1e-3, 0.9, 0.999, 1e-8, 3
    c1, c2 = 1 - beta1**step, 1 - beta2**step
    t = dtype
    scalars = (t(lr / c1), t(beta1), t(beta2), t(1 - beta1), t(1 - beta2), t(eps), t(c2))
    scalars += (t(0.99),)
    tiny = np.finfo(dtype).smallest_normal
    args = (p, rng.standard_normal(SIZE).astype(dtype), m, v, *scalars, tiny)
    (_, args_s), (_, args_p) = _both("_adam", args)
    assert not np.array_equal(args_s[0], p)
    assert not np.array_equal(args_s[2], m) and not np.array_equal(args_s[3], v)
    assert np.isfinite(args_s[0]).all()
    _assert_same_arrays(args_s, args_p)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("n", "build"),
    [(PARALLEL_MIN_ELEMENTS - 1, "serial"), (PARALLEL_MIN_ELEMENTS, "parallel")],
)
def test_sgd_dispatch_on_both_sides_of_the_threshold(n, build, dtype, threads, monkeypatch):
    """``Twin.__call__`` picks the build by size, and each side matches NumPy; a thread
    limited to one Numba thread (a batch thread) takes the serial build at any size."""
    before = nb.get_num_threads()
    nb.set_num_threads(min(threads, nb.config.NUMBA_NUM_THREADS))
    try:
        _dispatch(n, build if nb.get_num_threads() > 1 else "serial", dtype, monkeypatch)
    finally:
        nb.set_num_threads(before)


def _dispatch(n, build, dtype, monkeypatch):
    twin = nk._sgd
    called = []
    for name in ("serial", "parallel"):
        real = getattr(twin, name)

        def spy(*args, _real=real, _name=name):
            called.append(_name)
            return _real(*args)

        monkeypatch.setattr(twin, name, spy)
    rng = np.random.default_rng(7)
    p = rng.standard_normal(n).astype(dtype)
    g = rng.standard_normal(n).astype(dtype)
    lr = dtype(0.01)
    want = p - lr * g
    twin(p, g, lr)
    assert called == [build]
    np.testing.assert_allclose(p, want, rtol=0, atol=1e-7)


def _unwritten(shape, dtype) -> np.ndarray:
    """An output buffer the kernel must fill: NaN, so a kernel that writes nothing fails."""
    return np.full(shape, np.nan, dtype)


def _like_formula(got, want, dtype):
    """``got`` (a kernel's output) is the generic formula's to a few ulp, with no NaN left."""
    assert not np.isnan(got).any()
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * float(np.abs(want).max()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_backward(dtype):
    """Elementwise: exact, and the generic formula's."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(SIZE) * 3).astype(dtype)
    ref = get_backend("numpy", np.dtype(dtype).name).kernels
    t = Kernels.gelu(ref, x)[1]
    dy, dx = rng.standard_normal(SIZE).astype(dtype), _unwritten(SIZE, dtype)
    consts = seq.gelu_grad_constants(dtype)
    (_, args_s), (_, args_p) = _both("_gelu_backward", (dy, x, t, dx, *consts))
    _assert_same_arrays(args_s, args_p)
    _like_formula(args_s[3], Kernels.gelu_backward(ref, dy, x, t), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_and_its_input_grad(dtype):
    """Rows are independent (each thread takes whole rows): exact, and the generic formula's."""
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((ROWS, COLS)) * 3 + 1).astype(dtype)
    gamma, beta = rng.standard_normal(COLS).astype(dtype), rng.standard_normal(COLS).astype(dtype)
    ref = get_backend("numpy", np.dtype(dtype).name).kernels
    ones, consts = nk._row_constants(x, 1e-5)
    y, xhat, inv = _unwritten(x.shape, dtype), _unwritten(x.shape, dtype), _unwritten(ROWS, dtype)
    (_, args_s), (_, args_p) = _both("_layer_norm", (x, gamma, beta, ones, consts, y, xhat, inv))
    _assert_same_arrays(args_s, args_p)
    want = Kernels.layer_norm(ref, x, gamma, beta, 1e-5)
    for got, formula in zip(args_s[5:8], want, strict=True):
        _like_formula(got, formula.reshape(got.shape), dtype)
    dy, dx = rng.standard_normal((ROWS, COLS)).astype(dtype), _unwritten(x.shape, dtype)
    grad_args = (dy, args_s[6], args_s[7], gamma, ones, consts, dx)
    (_, args_s), (_, args_p) = _both("_layer_norm_input_grad", grad_args)
    _assert_same_arrays(args_s, args_p)
    dx_formula = Kernels.layer_norm_backward(ref, dy, want[1], want[2], gamma, True)[0]
    _like_formula(args_s[6], dx_formula, dtype)


@pytest.mark.parametrize("chunks", [1, 2, 5, ROWS])
@pytest.mark.parametrize("dtype", DTYPES)
def test_column_sums(dtype, chunks):
    """Per-chunk partial sums added in chunk order (the chunking an argument): exact in both
    builds, and NumPy's column sums."""
    dy = np.random.default_rng(9).standard_normal((ROWS, COLS)).astype(dtype)
    (db_s, args_s), (db_p, args_p) = _both("_column_sums", (dy, chunks))
    np.testing.assert_array_equal(db_p, db_s)
    _assert_same_arrays(args_s, args_p)
    _like_formula(db_s, dy.sum(axis=0), dtype)


@pytest.mark.parametrize("chunks", [1, 2, 5, ROWS])
def test_the_float32_bias_gelus_backward(chunks):
    """Elementwise gradients and per-chunk column sums: exact in both builds; the GELU's
    formula to a few ulp (its tanh computed again by a rational approximation)."""
    from xpnn.backends.kernels import GELU_A

    rng = np.random.default_rng(10)
    dy = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    x = (rng.standard_normal((ROWS, COLS)) * 3).astype(np.float32)
    ref = get_backend("numpy", "float32").kernels
    t = Kernels.gelu(ref, x)[1]
    c, c3a = seq.gelu_grad_constants(np.float32)[:2]
    args = (dy, x, seq.TANH_F32, c, np.float32(GELU_A), c3a, chunks)
    (db_s, args_s), (db_p, args_p) = _both("_bias_gelu_backward_f32", args)
    np.testing.assert_array_equal(db_p, db_s)
    _assert_same_arrays(args_s, args_p)
    want = Kernels.gelu_backward(ref, dy, x, t)
    _like_formula(args_s[0], want, np.float32)
    _like_formula(db_s, want.sum(axis=0), np.float32)
