"""CuPy arrays on one NVIDIA GPU, with fused CUDA kernels; CuPy is imported only when asked for."""

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np

from xpnn.backends.base import Backend
from xpnn.backends.common import CaptureFailed
from xpnn.backends.cupy_kernels import CupyKernels
from xpnn.errors import UserError


def import_cupy() -> Any:
    """Import CuPy and check that a CUDA device is usable; a UserError says which part is not."""
    try:
        import cupy
    except ImportError as exc:
        raise UserError(
            "`backend` cupy: CuPy is not installed (pip install 'xpnn[cuda12]' or "
            f"'xpnn[cuda13]'): {exc}"
        ) from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDA driver missing or broken: CuPy raises its own error types
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"`backend` cupy: no usable CUDA device ({msg})") from None
    if count < 1:
        raise UserError("`backend` cupy: no CUDA device found")
    return cupy


class CupyBackend(Backend):
    """GPU backend: arrays live on ``cuda:<device_id>``; transfers and syncs are explicit."""

    name = "cupy"
    is_gpu = True
    array_library = "cupy"

    def __init__(self, dtype: str = "float32", device_id: int = 0) -> None:
        cupy = import_cupy()
        self.device_id = device_id % cupy.cuda.runtime.getDeviceCount()
        cupy.cuda.Device(self.device_id).use()
        name = cupy.cuda.runtime.getDeviceProperties(self.device_id)["name"]
        name = name.decode() if isinstance(name, bytes) else name
        self.device = f"cuda:{self.device_id} ({name})"
        super().__init__(cupy, CupyKernels(cupy), dtype)

    def synchronize(self) -> None:
        self.xp.cuda.get_current_stream().synchronize()

    def to_host(self, a: Any) -> np.ndarray:
        return self.xp.asnumpy(a)

    def capture_unavailable(self) -> str | None:
        return None  # the device was found usable when this backend was made

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        cp = self.xp
        cp.cuda.get_current_stream().synchronize()  # the capture stream sees every write so far
        stream = cp.cuda.Stream(non_blocking=True)  # capture cannot use the legacy stream
        # the graph's own pool, kept with it: a block fn frees must not outlive a replay
        pool = cp.cuda.MemoryPool()
        with cp.cuda.using_allocator(pool.malloc), stream:
            stream.begin_capture()
            try:
                fn()
            except Exception as exc:
                with contextlib.suppress(Exception):  # out of capture mode, whatever the state
                    stream.end_capture()
                why = str(exc).splitlines()[0] if str(exc) else ""
                raise CaptureFailed(f"{type(exc).__name__}: {why}") from exc
            graph = stream.end_capture()

        def replay(kept: tuple = (stream, pool)) -> None:  # the graph outlives neither
            graph.launch()

        return replay
