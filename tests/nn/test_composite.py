"""Composite layers and the sequence-model layers: every backward against central finite
differences in float64 on every CPU backend (NumPy, Numba, PyTorch's CPU tensors, the array
API's strict namespace)."""

import array_api_strict as xs
import numpy as np
import pytest

from xpnn.backends import get_backend
from xpnn.backends.base import Backend
from xpnn.backends.kernels import Kernels
from xpnn.nn import (
    GELU,
    CausalSelfAttention,
    Chain,
    Dense,
    Embedding,
    FeedForward,
    LayerNorm,
    PositionEmbedding,
    Residual,
    Sequential,
    gpt,
    transformer_block,
)
from xpnn.nn.layer import Context
from xpnn.testing import numeric_grad

BACKENDS = ["numpy", "numba", "torch", "strict"]


def backend_of(name: str) -> Backend:
    if name == "torch":
        return get_backend("torch", "float64", device="cpu")
    if name != "strict":
        return get_backend(name, "float64")
    backend = Backend(xs, Kernels(xs), "float64")
    backend.to_host = lambda a: np.from_dlpack(a)
    return backend


def random_params(size: int, seed: int = 9) -> np.ndarray:
    """Parameters away from every initial value (LayerNorm's gamma 1 and beta 0, biases 0),
    where a backward that drops one of them shows: each value in +-[0.3, 1.2], either sign."""
    rng = np.random.default_rng(seed)
    return rng.uniform(0.3, 1.2, size) * rng.choice([-1.0, 1.0], size)


def fd_check(
    backend: Backend, layers, in_shape, x_host: np.ndarray, tol: float = 1e-7, at_random=True
):
    """Compare the input's and every parameter's gradient of ``sum(forward(x) * R)`` with
    central differences; parameters are perturbed in the flat buffer, on the backend. With
    ``at_random`` the parameters are ``random_params`` first, not the initial ones."""
    model = Sequential(layers).build(in_shape, backend, 0)
    if at_random:
        model.params[...] = backend.asarray(random_params(model.size))
    x = backend.asarray(x_host, dtype=None if x_host.dtype.kind == "f" else backend.xp.int64)
    ctx = Context(train=True, step=1, seed=3)
    rng = np.random.default_rng(5)
    r = rng.standard_normal(tuple(model.forward(x, ctx).shape))

    def f() -> float:
        return float(np.sum(backend.to_host(model.forward(x, ctx)) * r))

    model.forward(x, ctx)
    dx = model.backward(backend.asarray(r), need_dx=True)
    grads = backend.to_host(model.grads).copy()
    host = backend.to_host(model.params).copy()

    def f_params() -> float:
        model.params[...] = backend.asarray(host)
        return f()

    numeric = numeric_grad(f_params, host)
    model.params[...] = backend.asarray(host)
    np.testing.assert_allclose(grads, numeric, rtol=1e-5, atol=tol)
    if x_host.dtype.kind == "f":
        xh = x_host.copy()

        def f_x() -> float:
            nonlocal x
            x = backend.asarray(xh)
            return f()

        np.testing.assert_allclose(backend.to_host(dx), numeric_grad(f_x, xh), rtol=1e-5, atol=tol)
    return model


def _normal(*shape: int) -> np.ndarray:
    return np.random.default_rng(1).standard_normal(shape)


CASES = {
    "layernorm": (lambda: [LayerNorm()], (4, 6), lambda: _normal(3, 4, 6)),
    "gelu": (lambda: [GELU()], (4, 5), lambda: _normal(2, 4, 5) * 2),
    "dense_btd_tanh": (lambda: [Dense(5, "tanh")], (4, 6), lambda: _normal(3, 4, 6)),
    "dense_btd": (lambda: [Dense(3)], (2, 4, 6), lambda: _normal(2, 2, 4, 6)),
    "position": (lambda: [PositionEmbedding(6)], (4, 5), lambda: _normal(3, 4, 5)),
    "residual": (
        lambda: [Residual([LayerNorm(), Dense(6, "tanh")])],
        (4, 6),
        lambda: _normal(3, 4, 6),
    ),
    "attention": (lambda: [CausalSelfAttention(8, 2)], (5, 8), lambda: _normal(2, 5, 8)),
    "feedforward": (lambda: [FeedForward(6, 12)], (3, 6), lambda: _normal(2, 3, 6)),
    "block": (lambda: [transformer_block(8, 2)], (4, 8), lambda: _normal(2, 4, 8)),
    # ids repeat (7 rows, 24 positions): the scatter-add must add, not overwrite
    "embedding": (
        lambda: [Embedding(7, 5), Dense(3, "tanh")],
        (4,),
        lambda: np.random.default_rng(2).integers(0, 7, (6, 4)),
    ),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_backward_matches_finite_differences(case, backend):
    """At random parameters (``fd_check``'s default): a LayerNorm backward that drops gamma
    passes at gamma = 1."""
    make, in_shape, x = CASES[case]
    fd_check(backend_of(backend), make(), in_shape, x())


@pytest.mark.parametrize("backend", BACKENDS)
def test_gpt_loss_gradient_matches_finite_differences(backend):
    be = backend_of(backend)
    model = gpt(9, layers=2, heads=2, embed=8, block=5).build((5,), be, 0)
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 9, (3, 6))
    x = be.asarray(ids[:, :5], dtype=be.xp.int64)
    y = be.asarray(ids[:, 1:], dtype=be.xp.int64)
    model.loss_and_grads(x, y, Context(train=True), 1 / 3)
    grads = be.to_host(model.grads).copy()
    host = be.to_host(model.params).copy()

    def f() -> float:
        model.params[...] = be.asarray(host)
        loss, _ = model.loss(be.kernels, model.forward(x, Context()), y, 1.0)
        return float(be.to_host(loss)) / 3

    np.testing.assert_allclose(grads, numeric_grad(f, host), rtol=1e-5, atol=1e-8)


def test_gpt_loss_is_nats_per_token_and_accuracy_per_token():
    be = get_backend("numpy", "float64")
    model = gpt(5, layers=1, heads=1, embed=4, block=3).build((3,), be, 0)
    x = np.array([[0, 1, 2], [3, 4, 0]])
    y = np.array([[1, 2, 3], [4, 0, 1]])
    logits = model.forward(x, Context())
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    nll = -np.log(np.take_along_axis(p, y[..., None], -1))[..., 0]
    loss, correct = model.evaluate(x, y)
    assert np.isclose(float(loss), nll.mean(axis=1).sum())
    hits = (logits.argmax(-1) == y).mean(axis=1).sum()
    assert np.isclose(float(correct), hits)


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_softmax_masks_the_future_exactly(backend):
    be = backend_of(backend)
    s = _normal(2, 3, 5, 5) * 4
    p = be.to_host(be.kernels.causal_softmax(be.asarray(s)))
    future = np.triu(np.ones((5, 5), bool), 1)
    assert np.all(p[..., future] == 0)
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-14)
    ref = np.where(future, -np.inf, s)
    ref = np.exp(ref - ref.max(-1, keepdims=True))
    np.testing.assert_allclose(p, ref / ref.sum(-1, keepdims=True), rtol=1e-13)


def test_numba_sequence_kernels_equal_numpy():
    ref, got = get_backend("numpy", "float64").kernels, get_backend("numba", "float64").kernels
    s, dp = _normal(4, 6, 6), _normal(4, 6, 6)
    np.testing.assert_allclose(got.causal_softmax(s), ref.causal_softmax(s), rtol=1e-14)
    p = ref.causal_softmax(s)
    np.testing.assert_allclose(
        got.causal_softmax_backward(dp, p), ref.causal_softmax_backward(dp, p), atol=1e-15
    )
    x, dy_gelu = 3 * _normal(4, 6, 5), _normal(4, 6, 5)
    # NumPy's in-place GELU against the formula every other backend runs
    (y, t), (y_ref, t_ref) = got.gelu(x), Kernels.gelu(ref, x)
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(t, t_ref)
    np.testing.assert_allclose(
        got.gelu_backward(dy_gelu, x, t),
        ref.gelu_backward(dy_gelu, x, t_ref),
        rtol=1e-13,
        atol=1e-14,
    )
    ids, dy = np.array([3, 0, 3, 3, 1]), _normal(5, 4)
    out_ref, out_got = np.ones((5, 4)), np.ones((5, 4))
    ref.embedding_grad(ids, dy, out_ref)
    got.embedding_grad(ids, dy, out_got)
    np.testing.assert_array_equal(out_got, out_ref)  # rows added in the same order
    assert np.all(out_ref[[2, 4]] == 0) and np.allclose(out_ref[3], dy[[0, 2, 3]].sum(0))
    with pytest.raises(IndexError, match="embedding ids"):
        got.embedding_grad(np.array([5]), dy[:1], out_got)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", [(3, 2, 5, 4), (40, 4, 64, 32)])  # (B, heads, T, head dim)
def test_numba_attention_layer_norm_and_gelu_equal_the_generic_formulas(dtype, shape):
    """The fused, row-at-a-time Numba kernels (the larger shape's above the size where the
    parallel builds run) against the array-API formulas every other backend runs: the same
    bits where their sums group alike (rows of up to 128 values, 1/D exact), else to a few
    ulp."""
    _attention_layer_norm_and_gelu(dtype, shape)


def _attention_layer_norm_and_gelu(dtype, shape):
    ref, got = get_backend("numpy", dtype).kernels, get_backend("numba", dtype).kernels
    rng = np.random.default_rng(3)
    q, k, v, dout = (rng.standard_normal(shape).astype(dtype) for _ in range(4))
    (out, p), (out_ref, p_ref) = (
        got.causal_attention(q, k, v, 0.3),
        Kernels.causal_attention(ref, q, k, v, 0.3),
    )
    exact = shape[2] % 8 == 0
    check = np.testing.assert_array_equal if exact else _close
    check(p, p_ref)
    check(out, out_ref)
    grads = got.causal_attention_backward(dout, q, k, v, p_ref, 0.3)
    for g, g_ref in zip(
        grads, Kernels.causal_attention_backward(ref, dout, q, k, v, p_ref, 0.3), strict=True
    ):
        check(g, g_ref)
    x = (rng.standard_normal((*shape[:2], 128)) * 3 + 1).astype(dtype)
    gamma, beta = rng.standard_normal(128).astype(dtype), rng.standard_normal(128).astype(dtype)
    fwd, fwd_ref = (
        got.layer_norm(x, gamma, beta, 1e-5),
        Kernels.layer_norm(ref, x, gamma, beta, 1e-5),
    )
    for a, b in zip(fwd, fwd_ref, strict=True):
        np.testing.assert_array_equal(a, b)  # D = 128: NumPy's eight-way sums, 1/D exact
    dy = rng.standard_normal(x.shape).astype(dtype)
    bwd = got.layer_norm_backward(dy, fwd_ref[1], fwd_ref[2], gamma, True)
    bwd_ref = Kernels.layer_norm_backward(ref, dy, fwd_ref[1], fwd_ref[2], gamma, True)
    tol = 1e-5 if dtype == "float32" else 1e-13  # dgamma: rows summed in order, not pairwise
    for a, b in zip(bwd, bwd_ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * float(np.abs(b).max()))
    assert got.layer_norm_backward(dy, fwd_ref[1], fwd_ref[2], gamma, False)[0] is None
    xg = 3 * rng.standard_normal((*shape[:2], shape[2] * shape[2])).astype(dtype)
    for a, b in zip(got.gelu(xg), Kernels.gelu(ref, xg), strict=True):
        np.testing.assert_array_equal(a, b)  # NumPy's tanh between passes in the same order


def _close(a, b):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_composite_parameters_have_nested_names_in_one_flat_buffer():
    be = get_backend("numpy", "float64")
    model = Sequential([Dense(4), transformer_block(4, 2), Dense(2)]).build((3, 4), be, 0)
    names = list(model.named_params())
    assert names[:4] == ["layer0.W", "layer0.b", "layer1.attn.ln.gamma", "layer1.attn.ln.beta"]
    assert "layer1.attn.sa.qkv.W" in names and "layer1.mlp.ff.down.b" in names
    assert names[-2:] == ["layer2.W", "layer2.b"]
    block = model.layers[1]
    qkv = block.children["attn"].children["sa"].children["qkv"]
    assert np.shares_memory(qkv.params["W"], model.params)
    assert qkv.params["W"] is block.params["attn.sa.qkv.W"]
    assert sum(v.size for v in model.named_params().values()) == model.size


def test_residual_refuses_a_shape_change_and_replicas_keep_their_own_state():
    be = get_backend("numpy", "float64")
    with pytest.raises(ValueError, match="Residual: its layers map"):
        Sequential([Residual([Dense(3)])]).build((4,), be, 0)
    res = Residual({"norm": LayerNorm(), "dense": Dense(4)})
    Sequential([res]).build((4,), be, 0)
    twin = res.replica()
    res.forward(_normal(2, 4), Context())
    twin.forward(_normal(3, 4), Context())
    assert res.children["dense"].x.shape[0] == 2 and twin.children["dense"].x.shape[0] == 3
    assert twin.children["dense"].params["W"] is res.children["dense"].params["W"]


def test_bad_composites_are_refused():
    with pytest.raises(ValueError, match="without '.'"):
        Chain({"a.b": Dense(2)})
    with pytest.raises(TypeError, match="must be a Layer"):
        Residual([Dense(2), "relu"])
    with pytest.raises(ValueError, match="not a multiple of heads"):
        CausalSelfAttention(10, 4)
