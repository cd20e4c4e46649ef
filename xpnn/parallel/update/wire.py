"""The gradient exchange in a narrower float (``grad_dtype``); float16 times the loss scale."""

from collections.abc import Callable
from typing import Any

from xpnn.parallel.comm.narrow import NARROW, from_bits, quiet_overflows, to_bits

Array = Any
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
