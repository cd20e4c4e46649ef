"""16-bit floats as ``uint16`` bits, their MPI sum in float32 (Horovod's ``float16_sum``), and the
gradient exchange in a narrower float (``grad_dtype``); float16 times the loss scale."""

import contextlib
from collections.abc import Callable
from functools import cache, partial
from typing import Any

import numpy as np

Array = Any
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


GRAD_DTYPES = ("float32", "bfloat16", "float16")


def sends_gradients(comm: Any) -> bool:
    """Whether the update on ``comm`` sends gradients (node-shared ranks across nodes only)."""
    return comm.size > 1 and (not comm.node_memory or comm.nodes > 1)


class GradWire:
    """Gradient slices sent as ``dtype``; ``scale``: the loss scale at the time (float16)."""

    def __init__(self, dtype: str, xp: Any, scale: Callable[[], float] | None = None) -> None:
        self.dtype, self.xp, self.scale = dtype, xp, scale
        self.narrow = dtype in NARROW
        self.itemsize = 2 if self.narrow else 4  # bytes a value sent

    def pack(self, grads: Array) -> tuple[Array, float]:
        """A new buffer of ``grads`` (times the scale) as sent, and the scale used."""
        factor = self.scale() if self.scale is not None else 1.0
        values = grads * factor if factor != 1.0 else grads
        with quiet_overflows(self.xp):  # past the dtype's range: the loss scale's to handle
            if self.narrow:
                return to_bits(self.xp, values, self.dtype), factor
            return self.xp.astype(values, getattr(self.xp, self.dtype)), factor

    def unpack(self, buf: Array, factor: float, grads: Array) -> None:
        xp, dtype = self.xp, grads.dtype
        wide = from_bits(xp, buf, self.dtype, dtype) if self.narrow else xp.astype(buf, dtype)
        if factor != 1.0:
            wide *= 1.0 / factor  # a power of two: exact
        grads[...] = wide

    def start(self, comm: Any, grads: Array) -> "WireHandle":
        buf, factor = self.pack(grads)
        handle = comm.iallreduce_sum16_(buf, self.dtype) if self.narrow else comm.iallreduce_(buf)
        return WireHandle(handle, self, buf, factor, grads)

    def cross_allreduce_(self, comm: Any, grads: Array) -> None:
        """A node-shared communicator's ``cross_allreduce_`` of ``grads``, sent as ``dtype``."""
        buf, factor = self.pack(grads)
        if self.narrow:
            comm.cross_allreduce_sum16_(buf, self.dtype)
        else:
            comm.cross_allreduce_(buf)
        self.unpack(buf, factor, grads)


class WireHandle:
    """A handle whose ``wait`` also casts the sum back into the gradients."""

    __slots__ = ("_handle", "_wire", "_buf", "_factor", "_grads")

    def __init__(self, handle: Any, wire: GradWire, buf: Array, factor: float, grads: Array):
        self._handle, self._wire, self._buf = handle, wire, buf
        self._factor, self._grads = factor, grads

    def wait(self) -> None:
        if self._handle is None:
            return
        self._handle.wait()
        self._wire.unpack(self._buf, self._factor, self._grads)
        self._handle = self._buf = self._grads = None


def make_wire(grad_dtype: str | None, param_dtype: str, xp: Any, scale: Any) -> GradWire | None:
    """None where the gradients go as they are."""
    if grad_dtype is None or grad_dtype == param_dtype:
        return None
    return GradWire(grad_dtype, xp, scale if grad_dtype == "float16" else None)
