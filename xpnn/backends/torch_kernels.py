"""PyTorch's kernels: the dropout hash in int64 (no uint32 arithmetic), writes in place."""

from typing import Any

import torch

from xpnn.backends.kernels import Array, Kernels


class TorchKernels(Kernels):
    """The array-API reference on ``array_api_compat.torch``, writing into existing tensors."""

    HASH_DTYPE = "int64"

    def __init__(self, xp: Any) -> None:
        super().__init__(xp)
        self._scratch_of: dict[tuple, Array] = {}

    def _scratch(self, like: Array, dtype: Any = None) -> Array:
        """A tensor of ``like``'s shape, shared by every update of that size: no allocation."""
        key = (like.numel(), dtype or like.dtype, like.device)
        if key not in self._scratch_of:
            self._scratch_of[key] = torch.empty(key[0], dtype=key[1], device=key[2])
        return self._scratch_of[key].view(like.shape)

    def matmul_into(self, a: Array, b: Array, out: Array) -> Array:
        return torch.matmul(a, b, out=out)

    def bias_act(self, z: Array, b: Array, act: str) -> Array:
        z += b
        if act == "relu":
            return z.relu_()  # NaN stays NaN, as the generic kernel keeps it
        if act == "tanh":
            return z.tanh_()
        return self.activation(z, act)

    def flush_subnormal(self, x: Array) -> None:
        magnitude, tiny = self._scratch(x), self._scratch(x, torch.bool)
        torch.abs(x, out=magnitude)
        torch.lt(magnitude, torch.finfo(x.dtype).smallest_normal, out=tiny)
        x.masked_fill_(tiny, 0)  # NaN compares false: kept, as infinity is

    def sgd_update(self, p: Array, g: Array, lr: float) -> None:
        p.sub_(torch.mul(g, lr, out=self._scratch(p)))

    def momentum_update(self, p: Array, g: Array, v: Array, lr: float, mu: float) -> None:
        v.mul_(mu).add_(g)
        self.flush_subnormal(v)
        p.sub_(torch.mul(v, lr, out=self._scratch(p)))

    def adam_step(self, p, g, m, v, lr_c1, beta1, beta2, eps, c2, decay=1.0):
        """The generic formula, operation for operation (the same bits), in one scratch tensor."""
        t = self._scratch(p)
        if decay != 1.0:
            p.mul_(decay)
        m.mul_(beta1).add_(torch.mul(g, 1 - beta1, out=t))
        self.flush_subnormal(m)
        v.mul_(beta2).add_(torch.mul(g, g, out=t).mul_(1 - beta2))
        self.flush_subnormal(v)
        torch.div(v, c2, out=t).sqrt_().add_(eps)
        p.sub_(torch.div(m, t, out=t).mul_(lr_c1))
