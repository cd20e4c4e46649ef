"""How every Numba kernel is compiled, and the activations they share."""

import functools
import math
import types

import numba as nb

JIT = {"nogil": True, "cache": True, "error_model": "numpy"}  # no ZeroDivisionError branch
PARALLEL_MIN_ELEMENTS = 1 << 19  # below this a serial loop beats waking the thread team


class Twin:
    """A kernel compiled serial and parallel, the parallel one from ``min_elements`` on a team."""

    def __init__(self, fn, min_elements: int = PARALLEL_MIN_ELEMENTS) -> None:  # noqa: ANN001
        self.min_elements = min_elements
        self.serial = nb.njit(parallel=False, **JIT)(fn)
        copy = types.FunctionType(  # renamed: Numba's disk cache keys by name, not by flags
            fn.__code__, fn.__globals__, fn.__name__ + "_parallel", fn.__defaults__, fn.__closure__
        )
        copy.__qualname__ = fn.__qualname__ + "_parallel"
        self.parallel = nb.njit(parallel=True, **JIT)(copy)

    def __call__(self, first, *args):  # noqa: ANN001, ANN204
        big = first.size >= self.min_elements and nb.get_num_threads() > 1
        return (self.parallel if big else self.serial)(first, *args)


parallel_twin = functools.partial(Twin, min_elements=0)  # parallel at any size, given a team


ACT_CODE = {"identity": 0, "relu": 1, "sigmoid": 2, "tanh": 3}  # activations inside kernels


@nb.njit(**JIT)
def apply_act(v, code):  # pragma: no cover - compiled
    """``Kernels.activation`` of one value, the activation by its ``ACT_CODE``."""
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
    """``Kernels.activation_grad`` of one value ``g`` and the activation's output ``y``."""
    if code == 1:
        return g if y > 0 else 0.0
    if code == 2:
        return g * y * (1 - y)
    if code == 3:
        return g * (1 - y * y)
    return g
