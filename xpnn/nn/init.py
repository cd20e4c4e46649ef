"""Weight initialisers, drawn on the host so that every backend starts from the same numbers."""

import math
from typing import Any


def he_normal(rng: Any, shape: tuple[int, ...], fan_in: int) -> Any:
    """He et al. (2015): keeps ReLU activations' variance constant through depth."""
    return rng.standard_normal(shape) * math.sqrt(2.0 / fan_in)


def for_activation(rng: Any, shape: tuple[int, ...], fan_in: int, fan_out: int, act: str) -> Any:
    """He normal for ReLU; else Glorot & Bengio's (2010) uniform, for symmetric activations."""
    if act == "relu":
        return he_normal(rng, shape, fan_in)
    limit = math.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, size=shape)
