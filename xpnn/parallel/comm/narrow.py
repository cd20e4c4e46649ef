"""16-bit floats as ``uint16`` bits, and their MPI sum in float32 (Horovod's ``float16_sum``)."""

import contextlib
from functools import cache, partial
from typing import Any

import numpy as np

NARROW = ("bfloat16", "float16")  # the 16-bit floats a sum of bits may hold
BF16_NAN = 0x7FC0  # bfloat16's quiet NaN: a NaN's low bits would round it to infinity


def quiet_overflows(xp: Any) -> Any:
    """NumPy's overflow warnings silenced: a value past a 16-bit range is the loss scale's."""
    if (errstate := getattr(xp, "errstate", None)) is None:
        return contextlib.nullcontext()
    return errstate(over="ignore", invalid="ignore")


def check_narrow(dtype: str) -> None:
    if dtype not in NARROW:
        raise ValueError(f"16-bit float {dtype!r}: expected one of {', '.join(NARROW)}")


@cache
def native_dtype(xp: Any, dtype: str) -> Any:
    """``xp``'s own ``dtype``, else ``ml_dtypes``' where ``xp`` takes it (NumPy), else None."""
    found = getattr(xp, dtype, None)
    if found is not None:
        return found
    import ml_dtypes

    found = getattr(ml_dtypes, dtype)
    try:
        xp.zeros((1,), dtype=found)
    except (TypeError, ValueError, NotImplementedError):
        return None
    return found


def to_bits(xp: Any, values: Any, dtype: str) -> Any:
    """``values`` rounded to ``dtype`` (to nearest, ties to even), as a new ``uint16`` array."""
    native = native_dtype(xp, dtype)
    return (
        bfloat16_bits(xp, values) if native is None else xp.astype(values, native).view(xp.uint16)
    )


def bfloat16_bits(xp: Any, values: Any) -> Any:
    """``to_bits`` for bfloat16 in integers (CuPy): float32's upper half, rounded half to even."""
    wide = xp.astype(values, xp.float32)
    bits = wide.view(xp.uint32)
    rounded = xp.astype((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16, xp.uint16)
    return xp.where(xp.isnan(wide), xp.asarray(BF16_NAN, dtype=xp.uint16), rounded)


def from_bits(xp: Any, bits: Any, dtype: str, wide: Any) -> Any:
    """The ``dtype`` values whose ``uint16`` bits are ``bits``, as a new array of ``wide``."""
    native = native_dtype(xp, dtype)
    return bfloat16_values(xp, bits, wide) if native is None else xp.astype(bits.view(native), wide)


def bfloat16_values(xp: Any, bits: Any, wide: Any) -> Any:
    """``from_bits`` for bfloat16 in integers: the bits are float32's upper half."""
    return xp.astype((xp.astype(bits, xp.uint32) << 16).view(xp.float32), wide)


def _sum_into(dtype: str, inbuf: Any, inoutbuf: Any, datatype: Any = None) -> None:
    a = np.frombuffer(inbuf, dtype=np.uint16)
    b = np.frombuffer(inoutbuf, dtype=np.uint16)
    with quiet_overflows(np):  # an overflow is the loss scale's
        total = from_bits(np, a, dtype, np.float32)
        total += from_bits(np, b, dtype, np.float32)
        b[...] = to_bits(np, total, dtype)


@cache
def sum_op(dtype: str) -> Any:
    """The ``MPI.Op`` summing buffers of ``dtype``'s bits (one per process: mpi4py holds few)."""
    from mpi4py import MPI

    check_narrow(dtype)
    return MPI.Op.Create(partial(_sum_into, dtype), commute=True)
