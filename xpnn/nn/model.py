"""What the trainer, checkpoints and data-parallel updates ask of a model (``Model``: a user's
model implements these names), and what the strategies that swap or stage layers ask besides
(``LayeredModel``: ``Sequential``, a pipeline's stage). A strategy's wrapper says what part of
the network it holds (``xpnn.parallel.model.whole.share``); a core model holds all of it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from xpnn.nn.layer import Array, Context, Layer


@runtime_checkable
class Model(Protocol):
    """A built network whose parameters and gradients are two flat buffers of ``size``."""

    params: Array  # every parameter, one flat buffer on the backend
    grads: Array  # their gradients, laid out as ``params``
    size: int  # the parameters this rank holds
    backend: Any  # where the buffers live (``xp``, ``kernels``, ``to_host``)
    layer_offsets: list[int]  # where backward may report ``grads[offset:]`` final ([0]: at end)

    def build(self, input_shape: tuple[int, ...], backend: Any, seed: int) -> Model:
        """Draw the initial weights from ``seed`` and place them in the flat buffers."""
        ...

    def adopt(self, params: Array, grads: Array, copy: bool = True) -> None:
        """Move the parameters into ``params`` (copied if ``copy``), the gradients to ``grads``:
        node-shared memory, a lower precision's copies."""
        ...

    def loss_and_grads(
        self,
        x: Array | None,
        labels: Array,
        ctx: Context,
        scale: float,
        on_grads_ready: Callable[[int], None] | None = None,
    ) -> tuple[Array, Array]:
        """Forward, loss and backward; returns (loss sum, correct count) on the device."""
        ...

    def evaluate(self, x: Array | None, labels: Array) -> tuple[Array, Array]:
        """(loss sum, correct count) in evaluation mode."""
        ...

    def named_views(self, flat: Array) -> dict[str, Array]:
        """Stable names -> views of ``flat``, a buffer laid out as ``params``: what is saved."""
        ...

    def summary(self) -> str:
        """One line: the network and its parameter count."""
        ...


METHODS = ("build", "adopt", "loss_and_grads", "evaluate", "named_views", "summary")
BUILT = ("params", "grads", "size", "backend", "layer_offsets")  # what ``build`` sets


def lacks(model: Any, built: bool = False) -> list[str]:
    """The names of the ``Model`` protocol ``model`` lacks: its methods, or once ``built`` the
    attributes its ``build`` sets."""
    if built:
        return [name for name in BUILT if not hasattr(model, name)]
    return [name for name in METHODS if not callable(getattr(model, name, None))]


@runtime_checkable
class LayeredModel(Protocol):
    """What a built ``Model`` of layers in order offers besides: what tensor splits, pipeline
    stages, batch threads and node-shared activations work on."""

    layers: list[Layer]  # in order, each with its named parameters and gradients
    output_shape: tuple[int, ...]  # a sample's logits

    def attach(self, comm: Any) -> None:
        """Hand the layers the communicator of the ranks that hold this model."""
        ...

    def param_names(self) -> list[tuple[str, Layer, str]]:
        """(stable name, layer, the layer's own name) for every parameter, in order."""
        ...
