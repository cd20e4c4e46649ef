"""The Backend: all that is array-library specific, so network code never imports numpy or cupy."""

from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from xpnn.backends.kernels import Kernels

DTYPES = ("float32", "float64")  # what a backend computes in


class Backend:
    """An array namespace plus device, transfers, randomness, default dtype and kernel table."""

    name: str = "base"
    is_gpu: bool = False
    array_library: str = "numpy"  # whose arrays: node-shared memory is NumPy's only
    device: str = "cpu"  # GPU backends name theirs

    def __init__(self, xp: ModuleType, kernels: Kernels, dtype: str = "float32") -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be float32 or float64, not {dtype!r}")
        self.xp, self.kernels, self.dtype_name = xp, kernels, dtype
        self.dtype = getattr(xp, dtype)

    def synchronize(self) -> None:
        """Wait for queued device work; a no-op on the CPU, needed for honest GPU timings."""

    def capture_unavailable(self) -> str | None:
        """Why ``capture`` cannot record this backend's work (None: it can)."""
        return f"backend {self.name} runs each operation as it is called (graphs: backend cupy)"

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        """A replay of ``fn``'s device work as a CUDA graph; ``CaptureFailed`` if ``fn`` waits."""
        raise NotImplementedError(self.capture_unavailable())

    def asarray(self, a: Any, dtype: Any = None) -> Any:
        """Host (NumPy) data -> this backend's array, in ``dtype`` (default: the model dtype)."""
        return self.xp.asarray(a, dtype=self.dtype if dtype is None else dtype)

    def to_host(self, a: Any) -> np.ndarray:
        """This backend's array -> a NumPy array (a copy on GPU backends)."""
        return np.asarray(a)

    @staticmethod
    def host_rng(*seed: int) -> np.random.Generator:
        """A seeded host generator: weights drawn on the host are bit-identical on every backend."""
        return np.random.default_rng(list(seed))

    def pack_host(self, values: list[tuple[Any, tuple[int, ...]]]) -> np.ndarray:
        """Concatenate initial values (arrays or constants with shapes) into one host vector."""
        parts = [np.broadcast_to(np.asarray(v, dtype=np.float64), s).ravel() for v, s in values]
        return np.concatenate(parts) if parts else np.zeros(0)

    def describe(self) -> str:
        return f"{self.name} ({self.device}, {self.dtype_name})"
