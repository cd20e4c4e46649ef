"""The training recipe's optimizer pieces against hand-written formulas (and PyTorch when it is
installed): AdamW's decoupled decay on matrices only, clipping by the global norm, cosine
decay to a floor, and the hyper-parameters ``make_optimizer`` takes."""

import math
import re

import numpy as np
import pytest

from xpnn.backends import get_backend
from xpnn.train.optim import (
    GradClip,
    OptimArgError,
    Schedule,
    make_optimizer,
    matrix_ranges,
    pieces,
)

SHAPES = [(2, 3), (3,), (3, 2), (2,)]  # W, b, W, b laid end to end: 17 values
N = sum(math.prod(s) for s in SHAPES)
GRADS = np.random.default_rng(7).normal(size=(6, N))  # one gradient per step
P0 = np.random.default_rng(8).normal(size=N)


def _run(name, backend="numpy", parts=None, steps=6, lr=0.01, clip=None, **hyper):
    kernels = get_backend(backend, "float64").kernels
    p, g = P0.copy(), np.zeros(N)
    opt = make_optimizer(
        name, p, g, kernels, Schedule(lr), parts, matrices=matrix_ranges(SHAPES), clip=clip,
        **hyper,
    )  # fmt: skip
    for t in range(steps):
        g[...] = GRADS[t]
        opt.step()
    return p, opt


def _adamw_reference(lr, betas, eps, wd, steps=6):
    """torch.optim.AdamW's algorithm, written out: decay first, then Adam's step."""
    p, m, v = P0.copy(), np.zeros(N), np.zeros(N)
    decays = np.zeros(N, bool)
    for lo, hi in [(0, 6), (9, 15)]:  # the two matrices
        decays[lo:hi] = True
    for t in range(1, steps + 1):
        g = GRADS[t - 1]
        p = np.where(decays, p * (1 - lr * wd), p)
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        p = p - lr * (m / (1 - betas[0] ** t)) / (np.sqrt(v / (1 - betas[1] ** t)) + eps)
    return p


def test_matrix_ranges_cover_parameters_of_two_or_more_dimensions():
    assert matrix_ranges(SHAPES) == [(0, 6), (9, 15)]
    assert matrix_ranges([(4,), (2, 2, 3)]) == [(4, 16)]


def test_pieces_cut_a_part_at_the_ranges():
    assert pieces(slice(4, 12), N, [(0, 6), (9, 15)]) == [
        (slice(0, 2), True),
        (slice(2, 5), False),
        (slice(5, 8), True),
    ]
    assert pieces(slice(None), 5, []) == [(slice(0, 5), False)]


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize("parts", [None, [slice(0, 4), slice(4, 10), slice(10, N)]])
def test_adamw_decays_the_matrices_only(backend, parts):
    got, _ = _run("adamw", backend, parts, betas=(0.9, 0.95), eps=1e-7, weight_decay=0.3)
    want = _adamw_reference(0.01, (0.9, 0.95), 1e-7, 0.3)
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-15)
    plain, _ = _run("adam", backend, parts, betas=(0.9, 0.95), eps=1e-7)
    assert not np.allclose(got[:6], plain[:6], rtol=1e-9)  # the decay did something
    np.testing.assert_array_equal(got[6:9], plain[6:9])  # biases: Adam's bits


def test_adamw_without_decay_is_adam_bit_for_bit():
    np.testing.assert_array_equal(_run("adamw", weight_decay=0.0)[0], _run("adam")[0])


def test_adamw_matches_torch_in_float64():
    torch = pytest.importorskip("torch")
    lr, betas, eps, wd = 0.01, (0.9, 0.95), 1e-8, 0.1
    got, _ = _run("adamw", betas=betas, eps=eps, weight_decay=wd)
    offsets = np.cumsum([0] + [math.prod(s) for s in SHAPES])
    tensors = [
        torch.tensor(P0[a:b].reshape(s), dtype=torch.float64, requires_grad=True)
        for a, b, s in zip(offsets[:-1], offsets[1:], SHAPES, strict=True)
    ]
    groups = [
        {"params": [t for t in tensors if t.ndim >= 2], "weight_decay": wd},
        {"params": [t for t in tensors if t.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)
    for step in range(6):
        for t, a, b in zip(tensors, offsets[:-1], offsets[1:], strict=True):
            t.grad = torch.tensor(GRADS[step, a:b].reshape(t.shape), dtype=torch.float64)
        opt.step()
    want = np.concatenate([t.detach().numpy().ravel() for t in tensors])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)


def test_clipping_scales_to_the_global_norm_as_the_formula_says():
    lr, clip = 0.1, 0.5
    got, opt = _run("sgd", lr=lr, clip=GradClip(clip))
    p = P0.copy()
    for g in GRADS:
        norm = np.sqrt(np.sum(g * g))
        p = p - lr * g * min(1.0, clip / (norm + 1e-6))
    np.testing.assert_allclose(got, p, rtol=1e-13)
    assert opt.grad_norm == pytest.approx(np.linalg.norm(GRADS[-1]), rel=1e-13)


def test_clipping_leaves_gradients_within_the_norm_alone():
    big = GradClip(1e6)
    np.testing.assert_array_equal(_run("adam", clip=big)[0], _run("adam")[0])


def test_clipping_counts_the_total_over_ranks_and_skips_what_others_count():
    """A range another rank counts is left out here; ``total`` adds the other ranks' sums."""
    g = GRADS[0]
    seen = []

    def total(local):
        seen.append(local)
        return local + np.sum(g[6:9] ** 2)  # the rank that counts the replicated range

    _, opt = _run("sgd", clip=GradClip(0.1, total=total, skip=[(6, 9)]), steps=1)
    assert seen[0] == pytest.approx(np.sum(g * g) - np.sum(g[6:9] ** 2), rel=1e-13)
    assert opt.grad_norm**2 == pytest.approx(np.sum(g * g), rel=1e-13)


def test_clipping_matches_torch_clip_grad_norm():
    torch = pytest.importorskip("torch")
    t = torch.tensor(GRADS[0], dtype=torch.float64, requires_grad=True)
    t.grad = torch.tensor(GRADS[0], dtype=torch.float64)
    torch.nn.utils.clip_grad_norm_([t], 0.5)
    got, _ = _run("sgd", lr=1.0, clip=GradClip(0.5), steps=1)
    np.testing.assert_allclose(got, P0 - t.grad.numpy(), rtol=1e-13)


def test_momentum_betas_and_eps_reach_the_update():
    got, _ = _run("momentum", lr=0.1, momentum=0.5, steps=3)
    p, v = P0.copy(), np.zeros(N)
    for g in GRADS[:3]:
        v = 0.5 * v + g
        p = p - 0.1 * v
    np.testing.assert_allclose(got, p, rtol=1e-13)
    adam, _ = _run("adam", betas=(0.8, 0.99), eps=1e-3)
    want = _adamw_reference(0.01, (0.8, 0.99), 1e-3, 0.0)
    np.testing.assert_allclose(adam, want, rtol=1e-13)


@pytest.mark.parametrize(
    ("name", "hyper", "message"),
    [
        ("sgd", {"momentum": 0.9}, "`momentum`: not a hyper-parameter of `optimizer` sgd"),
        ("adam", {"weight_decay": 0.1}, "`weight_decay`: not a hyper-parameter"),
        ("momentum", {"betas": (0.9, 0.9)}, "`betas`: not a hyper-parameter"),
        ("adamw", {"weight_decay": -1.0}, "`weight_decay`: must be >= 0"),
        ("adam", {"betas": (0.9,)}, "`betas`: expected two rates"),
        ("adam", {"betas": (0.9, 1.0)}, "beta2 must be in [0, 1)"),
    ],
)
def test_bad_hyper_parameters_are_named(name, hyper, message):
    with pytest.raises(OptimArgError, match=re.escape(message)):
        _run(name, **hyper)


def test_bad_clip_norm_is_named():
    with pytest.raises(OptimArgError, match="`clip_norm`"):
        GradClip(0.0)


def test_warmup_then_cosine_to_the_floor():
    s = Schedule(1.0, "cosine", warmup_steps=4, total_steps=14, min_lr=0.1)
    assert [s(t) for t in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert s(4) == pytest.approx(1.0)
    assert s(9) == pytest.approx(0.1 + 0.9 * 0.5)  # half way down
    assert s(14) == pytest.approx(0.1)
    assert s(100) == pytest.approx(0.1)


def test_min_lr_above_lr_is_refused():
    with pytest.raises(OptimArgError, match="`min_lr`"):
        Schedule(0.1, "cosine", total_steps=5, min_lr=0.2)
