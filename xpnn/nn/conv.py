"""2-D convolution (NCHW) as im2col + one GEMM per layer, with reused column buffers, or as
the backend's direct kernel where that pays (few input channels: ``Kernels.conv_direct_pays``);
and ``Conv2DPool``, a ReLU convolution and the 2x2 max-pool after it as one layer where the
backend's fused kernels pay (``Kernels.conv_relu_pool_pays``): the pool's max is taken over the
GEMM's result and the bias and ReLU applied to the surviving quarter (the bias is constant per
channel and ReLU monotone: the same values), so the full-size activation is never written; the
backward writes the convolution's dL/dz straight from the pooled gradient. The two layers are
kept inside it, so parameters, their names, checkpoints and the parameter count are theirs."""

import copy
import math
from collections.abc import Iterator
from typing import Any

from xpnn.backends.kernels import ACTIVATIONS
from xpnn.nn.layer import Array, Context, Layer, check_int, he_normal
from xpnn.nn.pool import MaxPool2D
from xpnn.record.phases import WGRAD


def _pair(name: str, v: int | tuple[int, int]) -> tuple[int, int]:
    """An int ``k`` as ``(k, k)``, or a pair of ints, each >= 1."""
    if isinstance(v, (tuple, list)):
        if len(v) != 2:
            raise ValueError(f"Conv2D: {name} must be an int or a pair of ints, got {v!r}")
        return check_int("Conv2D", name, v[0]), check_int("Conv2D", name, v[1])
    k = check_int("Conv2D", name, v)
    return k, k


class Conv2D(Layer):
    """``y = act(conv(x, W) + b)`` on NCHW inputs, ``W`` (C_out, C_in, kh, kw), the activation
    fused into the bias pass; one flat pair of column and GEMM buffers, for the largest batch."""

    def __init__(
        self,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int = 1,
        padding: int = 0,
        activation: str = "identity",
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"Conv2D: unknown activation {activation!r}")
        self.activation = activation
        self.out_channels = check_int("Conv2D", "out_channels", out_channels)
        self.kh, self.kw = _pair("kernel_size", kernel_size)
        # the kernels take one stride and one padding for both axes
        if isinstance(stride, (tuple, list)) or isinstance(padding, (tuple, list)):
            raise TypeError(
                f"Conv2D: stride and padding must be ints (the same for both axes), "
                f"got stride={stride!r}, padding={padding!r}"
            )
        self.stride = check_int("Conv2D", "stride", stride)
        self.padding = check_int("Conv2D", "padding", padding, minimum=0)
        self._buffers: tuple[Array, Array] | None = None  # flat (cols, gemm) scratch
        self._dwt_buf: Array | None = None
        self.x: Array | None = None  # the input, where the forward was direct
        self.out_hw: tuple[int, int] | None = None  # all outputs the input allows
        self.used_hw: tuple[int, int] | None = None  # the outputs computed

    def setup(self, in_shape: tuple[int, ...], rng) -> tuple[int, ...]:  # noqa: ANN001
        if len(in_shape) != 3:
            raise ValueError(f"Conv2D expects (C, H, W) inputs, got shape {in_shape}")
        c, h, w = in_shape
        oh = (h + 2 * self.padding - self.kh) // self.stride + 1
        ow = (w + 2 * self.padding - self.kw) // self.stride + 1
        if oh < 1 or ow < 1:
            raise ValueError(f"Conv2D kernel {self.kh}x{self.kw} larger than input {in_shape}")
        self.in_shape, self.out_hw = in_shape, (oh, ow)
        self._dwt_buf = None  # a rebuild may change the channels or the dtype: fresh scratch
        self.limit_output(oh, ow)
        fan_in = c * self.kh * self.kw
        shape = (self.out_channels, c, self.kh, self.kw)
        self.add_param("W", he_normal(rng, shape, fan_in))
        self.add_param("b", 0.0, (self.out_channels,))
        return (self.out_channels, oh, ow)

    def output_positions(self, out_shape: tuple[int, ...]) -> int:
        return math.prod(self.used_hw or out_shape[1:])

    def limit_output(self, h: int, w: int) -> None:  # type: ignore[override]
        """Compute only output rows < ``h`` and columns < ``w``; the output shrinks to match."""
        if not (0 < h <= self.out_hw[0] and 0 < w <= self.out_hw[1]):
            raise ValueError(f"limit_output({h}, {w}) outside the {self.out_hw} outputs")
        self.used_hw = (int(h), int(w))
        self._buffers = None

    def _scratch(self, n: int, dtype) -> tuple[Array, Array]:  # noqa: ANN001
        """(cols, gemm) for a batch of ``n``: views of the start of the flat buffers."""
        xp, p = self.xp, n * self.used_hw[0] * self.used_hw[1]
        rows = (self.in_shape[0] * self.kh * self.kw, self.out_channels)
        old = self._buffers
        if old is None or old[0].dtype != dtype or old[0].shape[0] < rows[0] * p:
            old = self._buffers = self.cols = self.gemm = None  # the old pair goes first
            self._buffers = tuple(xp.empty((r * p,), dtype=dtype) for r in rows)
        pairs = zip(self._buffers, rows, strict=True)
        return tuple(xp.reshape(b[: r * p], (r, p)) for b, r in pairs)

    def replica(self) -> "Conv2D":
        twin = super().replica()
        twin._buffers = None  # backward reads the columns forward left in them
        twin._dwt_buf = None  # twins may run at once (batch threads): scratch of its own
        return twin

    def _dwt(self) -> Array:
        """Scratch for the transposed weight gradient (C_in*kh*kw, C_out)."""
        if self._dwt_buf is None:
            k = self.in_shape[0] * self.kh * self.kw
            self._dwt_buf = self.xp.empty((k, self.out_channels), dtype=self.grads["W"].dtype)
        return self._dwt_buf

    def _w2(self, grads: bool = False) -> Array:  # (C_out, C_in*kh*kw)
        w = self.grads["W"] if grads else self.params["W"]
        return self.xp.reshape(w, (self.out_channels, -1))

    def checked(self, x: Array) -> Array:
        """``x`` in the weights' dtype; a shape not built for refused."""
        if tuple(x.shape[1:]) != self.in_shape or x.ndim != 4:
            # the kernels index by the built geometry: another would overrun or silently crop
            raise ValueError(
                f"Conv2D built for input (C,H,W)={self.in_shape}, got batch shape {tuple(x.shape)}"
            )
        if x.dtype != self.params["W"].dtype:  # uint8 images, or float64 into a float32 net:
            x = self.xp.asarray(x, dtype=self.params["W"].dtype)  # the weights' dtype, as Dense
        return x

    def forward(self, x: Array, ctx: Context) -> Array:
        x, k = self.checked(x), self.kernels
        if self.direct():
            w, b = self.params["W"], self.params["b"]
            y = k.conv_direct(x, w, b, self.stride, self.padding, self.used_hw, self.activation)
            self.x = x  # the backward reads it; no columns are kept
        else:
            gemm = self.products(x)
            shape = (x.shape[0], self.out_channels, *self.used_hw)
            y = k.conv_output(gemm, self.params["b"], shape, self.activation)
        self.y = y if self.activation != "identity" else None
        return y

    def direct(self) -> bool:
        """Whether the forward runs ``Kernels.conv_direct`` (no columns, no GEMM result)."""
        return self.kernels.conv_direct_pays(self.in_shape[0], self.kh, self.kw, self.stride)

    def products(self, x: Array) -> Array:
        """im2col and the GEMM: the (C_out, N*OH*OW) result before the bias, kept as scratch
        for the backward's dL/dz (a fused layer after it reads it as it likes)."""
        self.x = None
        cols, gemm = self._scratch(x.shape[0], x.dtype)
        self.kernels.im2col(x, self.kh, self.kw, self.stride, self.padding, cols, self.used_hw)
        self.kernels.matmul_into(self._w2(), cols, gemm)
        self.x_shape, self.cols, self.gemm = tuple(x.shape), cols, gemm
        return gemm

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        k = self.kernels
        if self.x is not None:  # the forward was direct
            with WGRAD:  # (and the input's gradient, where it is asked for, in the same pass)
                w, dw = self.params["W"], self.grads["W"]
                geometry = (self.stride, self.padding, self.activation)
                db, dx = k.conv_direct_backward(dy, self.x, self.y, w, *geometry, dw, need_dx)
            self.grads["b"][...] = db
            return dx
        dyc, db = k.conv_output_grad(dy, self.gemm, self.y, self.activation)
        return self.products_backward(dyc, db, need_dx)

    def products_backward(self, dyc: Array, db: Array, need_dx: bool) -> Array | None:
        """The gradients from dL/dz as (C_out, N*OH*OW) (in ``products``' scratch) and dL/db."""
        k = self.kernels
        self.grads["b"][...] = db
        gw = self._w2(grads=True)
        with WGRAD:
            if gw.shape[0] <= gw.shape[1] <= dyc.shape[1]:
                # dW2.T = cols @ dY.T: 10-15% faster in OpenBLAS where the patch C_in*kh*kw is
                # the longer side and K = N*OH*OW longer still (else the copy costs more).
                gw[...] = self.xp.permute_dims(k.matmul_into(self.cols, dyc.T, self._dwt()), (1, 0))
            else:
                k.matmul_into(dyc, self.cols.T, gw)
        return self.input_grad(dyc) if need_dx else None

    def input_grad(self, dyc: Array) -> Array:
        """The input's gradient (its own method: ``python -m bench step_phases`` times it apart)."""
        dcols = self.kernels.matmul_into(self._w2().T, dyc, self.cols)
        geometry = (self.kh, self.kw, self.stride, self.padding, self.used_hw)
        return self.kernels.col2im(dcols, self.x_shape, *geometry)

    def __repr__(self) -> str:
        extra = f", stride={self.stride}" if self.stride != 1 else ""
        extra += f", padding={self.padding}" if self.padding else ""
        extra += f", {self.activation}" if self.activation != "identity" else ""
        if self.used_hw != self.out_hw:
            (uh, uw), (oh, ow) = self.used_hw, self.out_hw
            extra += f", computes {uh}x{uw} of {oh}x{ow}"
        return f"Conv2D({self.out_channels}, {self.kh}x{self.kw}{extra})"


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
