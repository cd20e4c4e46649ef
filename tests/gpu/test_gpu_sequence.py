"""The sequence kernels and the GPT on CuPy equal NumPy in float64: the causal softmax's CUDA
kernel and its backward, ``cupyx.scatter_add`` for the embedding, a whole GPT step.

Skipped, with the reason, where CuPy or a CUDA device is missing (as in CI); the CPU side is
tests/nn/test_composite.py."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import cupy_or_skip

pytestmark = pytest.mark.gpu

cupy = cupy_or_skip()

from xpnn.backends import get_backend  # noqa: E402
from xpnn.nn import gpt  # noqa: E402
from xpnn.nn.layer import Context  # noqa: E402


def test_sequence_kernels_equal_numpy():
    host, dev = get_backend("numpy", "float64").kernels, get_backend("cupy", "float64").kernels
    rng = np.random.default_rng(0)
    s, dp = rng.standard_normal((3, 2, 7, 7)) * 3, rng.standard_normal((3, 2, 7, 7))
    p = host.causal_softmax(s)
    np.testing.assert_allclose(cupy.asnumpy(dev.causal_softmax(cupy.asarray(s))), p, rtol=1e-12)
    got = dev.causal_softmax_backward(cupy.asarray(dp), cupy.asarray(p))
    np.testing.assert_allclose(cupy.asnumpy(got), host.causal_softmax_backward(dp, p), atol=1e-13)
    ids, dy = np.array([3, 0, 3, 3, 1]), rng.standard_normal((5, 4))
    out = np.ones((5, 4))
    host.embedding_grad(ids, dy, out)
    dev_out = cupy.ones((5, 4))
    dev.embedding_grad(cupy.asarray(ids), cupy.asarray(dy), dev_out)
    np.testing.assert_allclose(cupy.asnumpy(dev_out), out, rtol=1e-12, atol=1e-15)


def test_a_gpt_step_equals_numpy():
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 11, (4, 9))
    grads = []
    for name in ("numpy", "cupy"):
        be = get_backend(name, "float64")
        model = gpt(11, layers=2, heads=2, embed=8, block=8).build((8,), be, 0)
        x = be.asarray(ids[:, :8], dtype=be.xp.int64)
        y = be.asarray(ids[:, 1:], dtype=be.xp.int64)
        model.loss_and_grads(x, y, Context(train=True), 1 / 4)
        grads.append(be.to_host(model.grads))
    np.testing.assert_allclose(grads[1], grads[0], rtol=1e-9, atol=1e-12)
