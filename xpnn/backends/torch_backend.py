"""PyTorch tensors (``array_api_compat.torch``) on any device it reaches, imported when asked."""

from typing import Any

import numpy as np

from xpnn.backends.base import Backend
from xpnn.backends.kernels import Array, Kernels
from xpnn.errors import UserError

ACCELERATORS = ("cuda", "xpu", "mps")  # what ``auto`` tries, in this order, before the CPU


def import_torch() -> tuple[Any, Any]:
    """(torch, its array-API namespace); a UserError says which package is missing."""
    try:
        import torch
        from array_api_compat import torch as xp
    except ImportError as exc:
        raise UserError(
            "`backend` torch: PyTorch and array-api-compat are needed "
            f"(pip install 'xpnn[torch]'): {exc}"
        ) from None
    return torch, xp


def device_count(torch: Any, kind: str) -> int:
    """How many devices of ``kind`` (cuda, xpu, mps) this PyTorch build can use; 0 if none."""
    module = getattr(torch.backends if kind == "mps" else torch, kind, None)
    if module is None or not module.is_available():
        return 0
    return 1 if kind == "mps" else int(module.device_count())


def visible_devices() -> list[str]:
    """Every torch device this process sees, ``cpu`` first (for ``xpnn info``)."""
    torch, _ = import_torch()
    return ["cpu"] + [
        f"{kind}:{i} ({_device_name(torch, kind, i)})"
        for kind in ACCELERATORS
        for i in range(device_count(torch, kind))
    ]


def _device_name(torch: Any, kind: str, index: int) -> str:
    if kind == "mps":
        return "Apple GPU"
    try:
        return str(getattr(torch, kind).get_device_name(index))
    except Exception:  # a build without the query: the index is what there is to say
        return kind


def resolve_device(torch: Any, name: str | None, local_rank: int = 0) -> Any:
    """``device`` -> a ``torch.device``; an accelerator without an index: the rank's own."""
    if name in (None, "auto"):
        name = next((k for k in ACCELERATORS if device_count(torch, k)), "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise UserError(
            f"`device` {name!r}: not a PyTorch device (choose auto, cpu, cuda, mps, xpu, "
            "or one such as cuda:1)"
        ) from None
    if dev.type == "cpu":
        return torch.device("cpu")
    count = device_count(torch, dev.type)
    if count == 0:
        raise UserError(f"`device` {name}: this PyTorch build sees no {dev.type} device")
    if dev.index is None:
        return torch.device(dev.type, local_rank % count)  # mps: count 1, index 0
    if dev.index >= count:
        raise UserError(f"`device` {name}: only {count} {dev.type} device(s) seen")
    return dev


class TorchBackend(Backend):
    """Tensors on one torch device, made PyTorch's default so that ``xp.zeros(...)`` lands there."""

    name = "torch"
    array_library = "torch"

    def __init__(self, dtype: str = "float32", device: str | None = None, local_rank: int = 0):
        torch, xp = import_torch()
        self.torch = torch
        dev = self.torch_device = resolve_device(torch, device, local_rank)
        if dev.type == "mps" and dtype == "float64":
            raise UserError("`dtype` float64: Apple's MPS devices have no float64 (use float32)")
        self.is_gpu = dev.type != "cpu"
        if self.is_gpu:
            self.device = f"{dev} ({_device_name(torch, dev.type, dev.index or 0)})"
            if dev.type in ("cuda", "xpu"):
                getattr(torch, dev.type).set_device(dev)
            torch.set_default_device(dev)
        super().__init__(xp, TorchKernels(xp), dtype)

    def synchronize(self) -> None:
        if self.is_gpu:
            getattr(self.torch, self.torch_device.type).synchronize()

    def asarray(self, a: Any, dtype: Any = None) -> Any:
        """Host data -> a tensor on the device; a matching NumPy array on the CPU is shared."""
        dtype = self.dtype if dtype is None else dtype
        return self.torch.as_tensor(a, dtype=dtype, device=self.torch_device)

    def to_host(self, a: Any) -> np.ndarray:
        """A tensor -> NumPy: a view of a CPU tensor (as NumPy's backend returns), else a copy."""
        return a.detach().cpu().numpy() if isinstance(a, self.torch.Tensor) else np.asarray(a)


class TorchKernels(Kernels):
    """The array-API reference, writing into existing tensors; the dropout hash in int64."""

    HASH_DTYPE = "int64"

    def __init__(self, xp: Any) -> None:
        super().__init__(xp)
        self.torch = import_torch()[0]  # not imported with xpnn: it costs a second or more
        self._scratch_of: dict[tuple, Array] = {}

    def _scratch(self, like: Array, dtype: Any = None) -> Array:
        """A tensor of ``like``'s shape, shared by every update of that size: no allocation."""
        key = (like.numel(), dtype or like.dtype, like.device)
        if key not in self._scratch_of:
            self._scratch_of[key] = self.torch.empty(key[0], dtype=key[1], device=key[2])
        return self._scratch_of[key].view(like.shape)

    def matmul_into(self, a: Array, b: Array, out: Array) -> Array:
        return self.torch.matmul(a, b, out=out)

    def bias_act(self, z: Array, b: Array, act: str) -> Array:
        z += b
        if act == "relu":
            return z.relu_()  # NaN stays NaN, as the generic kernel keeps it
        if act == "tanh":
            return z.tanh_()
        return self.activation(z, act)

    def flush_subnormal(self, x: Array) -> None:
        magnitude, tiny = self._scratch(x), self._scratch(x, self.torch.bool)
        self.torch.abs(x, out=magnitude)
        self.torch.lt(magnitude, self.torch.finfo(x.dtype).smallest_normal, out=tiny)
        x.masked_fill_(tiny, 0)  # NaN compares false: kept, as infinity is

    def sgd_update(self, p: Array, g: Array, lr: float) -> None:
        p.sub_(self.torch.mul(g, lr, out=self._scratch(p)))

    def momentum_update(self, p: Array, g: Array, v: Array, lr: float, mu: float) -> None:
        v.mul_(mu).add_(g)
        self.flush_subnormal(v)
        p.sub_(self.torch.mul(v, lr, out=self._scratch(p)))

    def adam_step(self, p, g, m, v, lr_c1, beta1, beta2, eps, c2, decay=1.0):
        """The generic formula, operation for operation (the same bits), in one scratch tensor."""
        t = self._scratch(p)
        if decay != 1.0:
            p.mul_(decay)
        m.mul_(beta1).add_(self.torch.mul(g, 1 - beta1, out=t))
        self.flush_subnormal(m)
        v.mul_(beta2).add_(self.torch.mul(g, g, out=t).mul_(1 - beta2))
        self.flush_subnormal(v)
        self.torch.div(v, c2, out=t).sqrt_().add_(eps)
        p.sub_(self.torch.div(m, t, out=t).mul_(lr_c1))
