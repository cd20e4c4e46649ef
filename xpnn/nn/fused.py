"""A ReLU convolution and the 2x2 max-pool after it as one layer, where the backend's fused
kernels pay (``Kernels.conv_relu_pool_pays``): the pool's max is taken over the GEMM's result
and the bias and ReLU applied to the surviving quarter (the bias is constant per channel and
ReLU monotone: the same values), so the full-size activation is never written; the backward
writes the convolution's dL/dz straight from the pooled gradient. The two layers are kept
inside it, so parameters, their names, checkpoints and the parameter count are theirs."""

import copy
from collections.abc import Iterator
from typing import Any

from xpnn.nn.conv import Conv2D
from xpnn.nn.layer import Array, Context, Layer
from xpnn.nn.pool import MaxPool2D
from xpnn.record.phases import WGRAD


class Conv2DPool(Layer):
    """``MaxPool2D(2)(Conv2D(..., activation="relu")(x))``, fused where the kernels allow."""

    def __init__(self, conv: Conv2D, pool: MaxPool2D) -> None:
        super().__init__()
        self.conv, self.pool = conv, pool
        self.children = {"conv": conv, "pool": pool}  # what the planner's work counts
        self.params, self.grads, self.initial = conv.params, conv.grads, conv.initial
        self.fusable, self.extent = False, None

    def setup(self, in_shape: tuple[int, ...], rng: Any) -> tuple[int, ...]:
        shape = self.conv.build(in_shape, self.backend, rng)
        out = self.pool.build(shape, self.backend, rng)
        self.extent = self.pool.extent_read(shape)  # OH, OW: twice the pool's
        self.conv.limit_output(*self.extent)
        self.fusable = self.kernels.conv_relu_pool_pays()
        return out

    @property
    def fused(self) -> bool:
        """Whether the fused kernels run (not where the convolution was made to compute
        outputs the pool does not read)."""
        return self.fusable and self.conv.used_hw == self.extent

    def bind(self, name: str, param: Array, grad: Array) -> None:
        super().bind(name, param, grad)
        self.conv.bind(name, param, grad)  # a batch thread's twin has dicts of its own

    def walk(self) -> Iterator[Layer]:
        yield self
        yield from (self.conv, self.pool)

    def output_positions(self, out_shape: tuple[int, ...]) -> int:
        return self.conv.output_positions(out_shape)

    def forward(self, x: Array, ctx: Context) -> Array:
        conv = self.conv
        if not self.fused:
            return self.pool.forward(conv.forward(x, ctx), ctx)
        x, w, b = conv.checked(x), conv.params["W"], conv.params["b"]
        self.shape = (x.shape[0], conv.out_channels, *conv.used_hw)
        if conv.direct():
            conv.x = x  # the backward reads it
            geometry = (conv.stride, conv.padding, conv.used_hw)
            self.y, self.idx = self.kernels.conv_direct_relu_pool(x, w, b, *geometry)
        else:
            self.y, self.idx = self.kernels.conv_relu_pool(conv.products(x), b, self.shape)
        return self.y

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        if not self.fused:
            return self.conv.backward(self.pool.backward(dy), need_dx)
        k, conv = self.kernels, self.conv
        if conv.x is None:
            dyc, db = k.conv_relu_pool_grad(dy, self.y, self.idx, self.shape, conv.gemm)
            return conv.products_backward(dyc, db, need_dx)
        with WGRAD:  # as ``Conv2D``'s direct backward
            w, dw, geometry = conv.params["W"], conv.grads["W"], (conv.stride, conv.padding)
            pooled = (dy, conv.x, self.y, self.idx)
            db, dx = k.conv_direct_relu_pool_backward(*pooled, w, *geometry, dw, need_dx)
        conv.grads["b"][...] = db
        return dx

    def replica(self) -> "Conv2DPool":
        twin = copy.copy(self)  # the same parameter views; each layer its own forward state
        twin.conv, twin.pool = self.conv.replica(), self.pool.replica()
        twin.children = {"conv": twin.conv, "pool": twin.pool}
        return twin

    def __repr__(self) -> str:
        return f"{self.conv!r} -> {self.pool!r}{' (fused)' if self.fused else ''}"


def fuse_conv_pool(layers: list[Layer], kernels: Any, fuse: bool = True) -> list[Layer]:
    """``layers`` with each ``Conv2D(relu)`` and the ``MaxPool2D(2)`` right after it as one
    ``Conv2DPool`` where ``kernels`` fuse them; without ``fuse``, each taken apart again."""
    out: list[Layer] = []
    for layer in layers:
        if type(layer) is Conv2DPool and not fuse:
            out += [layer.conv, layer.pool]
            continue
        conv = out[-1] if out else None
        pair = fuse and kernels.conv_relu_pool_pays() and type(conv) is Conv2D
        pair = pair and conv.activation == "relu"
        if pair and type(layer) is MaxPool2D and layer.size == layer.stride == 2:
            out[-1] = Conv2DPool(conv, layer)
        else:
            out.append(layer)
    return out
