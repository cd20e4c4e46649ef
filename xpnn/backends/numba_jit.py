"""How every Numba kernel is compiled, and the activations they share, in one place.

NumPy's error model: no ``ZeroDivisionError`` branch to stop LLVM vectorising, and x / 0 gives
inf or nan as on NumPy (docs/decisions/numba-wait-policy.md).
"""

from __future__ import annotations

import math

import numba as nb

JIT = {"nogil": True, "cache": True, "error_model": "numpy"}
ACT_CODE = {"identity": 0, "relu": 1, "sigmoid": 2, "tanh": 3}  # activations inside kernels


@nb.njit(**JIT)
def apply_act(v, code):  # pragma: no cover - compiled
    """The activation ``code`` (``ACT_CODE``) of one value: ``Kernels.activation``'s math."""
    if code == 1:
        return 0.0 if v <= 0 else v  # NaN stays NaN, as in NumPy
    if code == 2:
        e = math.exp(-abs(v))
        return 1 / (1 + e) if v >= 0 else e / (1 + e)
    if code == 3:
        return math.tanh(v)
    return v


@nb.njit(**JIT)
def apply_act_grad(g, y, code):  # pragma: no cover - compiled
    """dL/dz from dL/dy ``g`` and the activation's output ``y``: ``activation_grad``'s math."""
    if code == 1:
        return g if y > 0 else 0.0
    if code == 2:
        return g * y * (1 - y)
    if code == 3:
        return g * (1 - y * y)
    return g
