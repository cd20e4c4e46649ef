"""Layers in order; parameters in one flat buffer, gradients in another (few slices to reduce)."""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable
from functools import partial
from typing import Any

from xpnn.errors import UserError
from xpnn.nn.conv import fuse_conv_pool
from xpnn.nn.layer import Array, Context, Layer, copy_array
from xpnn.nn.losses import LOSSES, SoftmaxCrossEntropy
from xpnn.record.phases import FORWARD, layer_span, span

Ready = Callable[[int], None] | None  # on_grads_ready(offset): ``grads[offset:]`` is final


def adding(acc: Array, grads: Array, on_grads_ready: Ready) -> Callable[[int], None]:
    """An ``on_grads_ready`` first adding ``acc`` (earlier passes') into each final slice."""
    done = [grads.shape[0]]

    def ready(offset: int) -> None:
        grads[offset : done[0]] += acc[offset : done[0]]
        done[0] = offset
        if on_grads_ready is not None:
            on_grads_ready(offset)

    return ready


DEBUG_HINT = "XPNN_DEBUG=1 prints the traceback"


class LayerError(UserError):
    """A user's layer failed or gave a wrong shape, named (else the error names a later one)."""

    def __init__(self, index: int, what: str) -> None:
        super().__init__(f"`model` layer {index} {what}")
        self.index, self.what = index, what  # a pipeline stage counts its first layer on


def checked_call(
    index: int, layer: Layer, call: str, fn: Callable[[], Any], want: tuple[int, ...] | None
) -> Any:
    """A user's layer's ``fn()``; a failure or a shape not ``want`` (broadcasting): LayerError."""
    name = f"({type(layer).__name__}) {call}"
    try:
        out = fn()
    except (UserError, MemoryError):
        raise
    except Exception as exc:  # noqa: BLE001 -- the user's code: any error is theirs
        text = " | ".join(line for line in str(exc).splitlines() if line.strip())
        raise LayerError(index, f"{name}: {type(exc).__name__}: {text} ({DEBUG_HINT})") from exc
    shape = getattr(out, "shape", None)
    if want is not None and (shape is None or tuple(shape) != want):
        got = f"shape {tuple(shape)}" if shape is not None else f"a {type(out).__name__}"
        what = "the gradient of its input" if call == "backward" else "its output"
        said = f"returned {got} as {what}, expected shape {want} ({DEBUG_HINT})"
        raise LayerError(index, f"{name} {said}")
    return out


class Sequential:
    """Layers in order: the ``Model`` the trainer, checkpoints and parallel strategies use."""

    train_rows = 0  # the largest batch ``loss_and_grads`` has seen (``evaluate`` slices by it)

    def __init__(self, layers: list[Layer], loss: Any = None, fuse: bool = True) -> None:
        self.layers = layers
        self.fuse = fuse  # each ReLU convolution and its 2x2 pool as one layer (``Conv2DPool``)
        if loss is None or isinstance(loss, str):  # a name or class of ``LOSSES``, or a callable
            if loss not in (None, *LOSSES):
                raise ValueError(f"unknown loss {loss!r} (choose {', '.join(LOSSES)})")
            loss = LOSSES.get(loss, SoftmaxCrossEntropy)
        if isinstance(loss, type) and loss in LOSSES.values():
            loss = loss()
        if not callable(loss):
            raise TypeError(f"loss must be a loss name or a callable loss object, got {loss!r}")
        self.loss = loss

    def build(self, input_shape: tuple[int, ...], backend: Any, seed: int) -> Sequential:
        if (layers := fuse_conv_pool(self.layers, backend.kernels, self.fuse)) != self.layers:
            self.layers = layers
        return self.setup(input_shape, backend, seed).place()

    def setup(self, input_shape: tuple[int, ...], backend: Any, seed: int) -> Sequential:
        """Draw every layer's initial values on the host and learn its output shape."""
        self.backend, self.xp = backend, backend.xp
        rng = backend.host_rng(seed, 0)
        self.shapes = [tuple(input_shape)]
        for layer in self.layers:
            self.shapes.append(layer.build(self.shapes[-1], backend, rng))
        self.output_shape = self.shapes[-1]
        for layer, after, shape in zip(self.layers, self.layers[1:], self.shapes[1:], strict=False):
            if (extent := after.extent_read(shape)) is not None:  # a Conv2D before a pool
                layer.limit_output(*extent)
        return self

    def place(self) -> Sequential:
        initial = [v for layer in self.layers for v in layer.initial.values()]
        params = self.backend.asarray(self.backend.pack_host(initial))
        for layer in (inner for top in self.layers for inner in top.walk()):
            layer.initial = {n: (None, shape) for n, (_, shape) in layer.initial.items()}
        self._bind(params, self.xp.zeros_like(params))
        return self

    def adopt(self, params: Array, grads: Array, copy: bool = True) -> None:
        if copy:
            params[...] = self.params
        self._bind(params, grads)

    def _bind(self, params: Array, grads: Array) -> None:
        self.params, self.grads = params, grads
        views, grad_views = self.named_views(params), self.named_views(grads)
        for key, layer, name in self.param_names():  # a dotted name binds a sublayer's
            layer.bind(name, views[key], grad_views[key])
        sizes = [sum(math.prod(shape) for _, shape in x.initial.values()) for x in self.layers]
        *self.layer_offsets, self.size = itertools.accumulate(sizes, initial=0)

    def attach(self, comm: Any) -> None:
        for layer in (inner for top in self.layers for inner in top.walk()):
            layer.attach(comm)

    def forward(self, x: Array, ctx: Context) -> Array:
        with FORWARD:
            for i, layer in enumerate(self.layers):
                with layer_span("forward", i, layer):
                    if self._is_users(layer):
                        call = partial(layer.forward, x, ctx)
                        x = checked_call(i, layer, "forward", call, self._batch_shape(x, i + 1))
                    else:
                        x = layer.forward(x, ctx)
        return x

    def _is_users(self, layer: Layer) -> bool:
        """Whether ``layer`` is (or holds) a layer not from xpnn: its calls are checked."""
        known = self.__dict__.setdefault("_users", {})
        if id(layer) not in known:
            known[id(layer)] = not all(type(x).__module__.startswith("xpnn.") for x in layer.walk())
        return known[id(layer)]

    def _batch_shape(self, a: Any, at: int) -> tuple[int, ...] | None:
        """(batch, *the per-sample shape of layer ``at``'s input), where known."""
        shapes = getattr(self, "shapes", None)
        if shapes is None or len(shapes) != len(self.layers) + 1 or not hasattr(a, "shape"):
            return None
        return (a.shape[0], *shapes[at])

    def predict(self, x: Array) -> Array:
        """The logits of ``x`` in evaluation mode (dropout off)."""
        return self.forward(self.backend.asarray(x), Context(train=False))

    def backward(self, dlogits: Array, on_grads_ready: Ready = None, need_dx: bool = False) -> Any:
        """``backprop`` of a copy of ``dlogits`` (the caller's is left alone)."""
        return self.backprop(copy_array(self.xp, dlogits), on_grads_ready, need_dx)

    def backprop(self, dy: Array, on_grads_ready: Ready = None, need_dx: bool = False) -> Any:
        """Assign every gradient from ``dy`` (fused kernels write over it); dx if ``need_dx``."""
        layers = self.layers
        for i in range(len(layers) - 1, -1, -1):
            with layer_span("backward", i, layers[i]):
                need = self.needs_input_grad(i, need_dx)
                if self._is_users(layers[i]):
                    want = self._batch_shape(dy, i) if need else None
                    call = partial(layers[i].backward, dy, need_dx=need)
                    dy = checked_call(i, layers[i], "backward", call, want)
                else:
                    dy = layers[i].backward(dy, need_dx=need)
            if on_grads_ready is not None:
                on_grads_ready(self.layer_offsets[i])
        return dy if need_dx else None

    def needs_input_grad(self, index: int, need_dx: bool = False) -> bool:
        """Whether layer ``index``'s input gradient is read (a layer below learns; ``need_dx``)."""
        return self.layer_offsets[index] > 0 or need_dx

    def loss_and_grads(
        self, x: Array, labels: Array, ctx: Context, scale: float, on_grads_ready: Ready = None
    ) -> tuple[Array, Array]:
        self.train_rows = max(self.train_rows, labels.shape[0])
        logits = self.forward(x, ctx)
        with span("loss"):
            correct = self.backend.kernels.count_correct(logits, labels)
            loss, dlogits = self.loss(self.backend.kernels, logits, labels, scale)
        self.backprop(dlogits, on_grads_ready)  # dlogits is ours to give up
        return loss, correct

    def evaluate(self, x: Array, labels: Array) -> tuple[Array, Array]:
        """(loss sum, number correct) in eval mode, in slices of the largest training batch."""
        n = labels.shape[0]
        rows = self.train_rows or n
        loss = correct = None
        for lo in range(0, max(n, 1), max(rows, 1)):
            part = slice(lo, min(lo + rows, n))  # the array API: no stop past the end
            logits = self.forward(x[part, ...], Context(train=False))
            l, _ = self.loss(self.backend.kernels, logits, labels[part, ...], 1.0)
            c = self.backend.kernels.count_correct(logits, labels[part, ...])
            loss, correct = (l, c) if loss is None else (loss + l, correct + c)
        return loss, correct

    def named_params(self) -> dict[str, Array]:
        """Stable names -> views (``layerN`` counts layers with parameters); what is saved."""
        return {key: layer.params[name] for key, layer, name in self.param_names()}

    def named_views(self, flat: Array) -> dict[str, Array]:
        views, offset = {}, 0
        for key, layer, name in self.param_names():
            shape = layer.initial[name][1]  # as bound: the flat buffers' one layout
            views[key] = self.xp.reshape(flat[offset : offset + math.prod(shape)], shape)
            offset += math.prod(shape)
        return views

    def param_names(self) -> list[tuple[str, Layer, str]]:
        layers = [layer for layer in self.layers if layer.initial]  # what ``layerN`` counts
        return [(f"layer{i}.{n}", x, n) for i, x in enumerate(layers) for n in x.initial]

    def replica(self) -> Sequential:
        """A twin on the same parameters whose layers keep their own forward state."""
        twin = copy.copy(self)
        twin.layers = [layer.replica() for layer in self.layers]
        return twin

    def summary(self) -> str:
        return " -> ".join(repr(layer) for layer in self.layers) + f"  ({self.size:,} parameters)"
