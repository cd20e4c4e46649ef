"""Every optimizer on every CPU backend (NumPy, Numba, PyTorch's CPU tensors) against one
reference written out in float64: the update each kernel runs, AdamW's decoupled decay on the
matrices alone, and a warmup's changing learning rate."""

import math

import numpy as np
import pytest

from xpnn.backends import get_backend
from xpnn.train.optim import Schedule, make_optimizer, matrix_ranges

SHAPES = [(3, 4), (4,), (4, 2), (2,)]  # W, b, W, b laid end to end
N = sum(math.prod(s) for s in SHAPES)
STEPS = 5
GRADS = np.random.default_rng(21).normal(size=(STEPS, N))
P0 = np.random.default_rng(22).normal(size=N)
SCHEDULE = {"base_lr": 0.05, "warmup_steps": 2}
HYPER = {  # every hyper-parameter away from its default, so a dropped one shows
    "sgd": {},
    "momentum": {"momentum": 0.8},
    "adam": {"betas": (0.85, 0.99), "eps": 1e-6},
    "adamw": {"betas": (0.85, 0.99), "eps": 1e-6, "weight_decay": 0.4},
}
BACKENDS = ["numpy", "numba", "torch"]


def reference(name: str) -> np.ndarray:
    """The textbook updates (PyTorch's, for momentum and AdamW), step by step."""
    hyper, lr_at = HYPER[name], Schedule(**SCHEDULE)
    p, m, v = P0.copy(), np.zeros(N), np.zeros(N)
    decays = np.zeros(N, bool)
    for lo, hi in matrix_ranges(SHAPES):
        decays[lo:hi] = True
    for t in range(1, STEPS + 1):
        g, lr = GRADS[t - 1], lr_at(t - 1)
        if name == "sgd":
            p = p - lr * g
        elif name == "momentum":
            m = hyper["momentum"] * m + g
            p = p - lr * m
        else:
            (b1, b2), eps = hyper["betas"], hyper["eps"]
            if name == "adamw":
                p = np.where(decays, p * (1 - lr * hyper["weight_decay"]), p)
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            p = p - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    return p


def trained(name: str, backend_name: str) -> np.ndarray:
    """The parameters after ``STEPS`` steps of ``name`` on the backend's own arrays."""
    if backend_name == "torch":
        pytest.importorskip("torch")
        backend = get_backend("torch", "float64", device="cpu")
    else:
        backend = get_backend(backend_name, "float64")
    p, g = backend.asarray(P0.copy()), backend.asarray(np.zeros(N))
    opt = make_optimizer(
        name, p, g, backend.kernels, Schedule(**SCHEDULE), matrices=matrix_ranges(SHAPES),
        **HYPER[name],
    )  # fmt: skip
    for step in range(STEPS):
        g[...] = backend.asarray(GRADS[step])
        opt.step()
    return np.array(backend.to_host(p))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(HYPER))
def test_every_optimizer_on_every_cpu_backend_matches_the_reference(name, backend):
    got = trained(name, backend)
    np.testing.assert_allclose(got, reference(name), rtol=1e-12, atol=1e-14)
    assert not np.allclose(got, P0, rtol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_adamw_weight_decay_changes_the_matrices_on_every_backend(backend):
    """The reference's decay is not a no-op at these numbers: a backend that drops it fails."""
    decayed, plain = trained("adamw", backend), reference("adam")
    lo, hi = matrix_ranges(SHAPES)[0]
    assert np.abs(decayed[lo:hi] - plain[lo:hi]).max() > 1e-3
