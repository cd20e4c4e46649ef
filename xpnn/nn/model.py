"""The ``Model`` protocol: what the trainer, checkpoints and parallel strategies may ask of a
model. ``Sequential`` and a pipeline's ``PipelineStage`` implement it; the attributes with
defaults are declared on them, so no strategy probes for them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from xpnn.nn.layer import Array, Context, Layer


@runtime_checkable
class Model(Protocol):
    """A built network whose parameters and gradients are two flat buffers of ``size``."""

    layers: list[Layer]  # in order, each with its named parameters and gradients
    params: Array  # every parameter, one flat buffer on the backend
    grads: Array  # their gradients, laid out as ``params``
    size: int  # this rank's parameters
    backend: Any  # where the buffers live (``xp``, ``kernels``, ``to_host``)
    scores: bool  # its loss is the network's (a pipeline's earlier stages have none)
    input_grad: bool  # backward returns the input's gradient (a pipeline's later stages)
    reads_input: bool  # forward reads the samples (a pipeline's first stage)
    first_param_layer: int  # layers with parameters before this model's first (naming)
    stages: int  # pipeline stages the network is cut into (1: it is whole here)
    whole_param_count: int | None  # the whole network's parameters, where not all are here
    layer_offsets: list[int]  # where each layer's parameters start in ``params``
    part: int  # the tensor part of a pipeline stage this rank holds (0 outside 3-D)
    split_comm: Any  # the ranks holding the other slices of its split layers (None: its comm)

    def build(self, input_shape: tuple[int, ...], backend: Any, seed: int) -> Model:
        """Draw the initial weights from ``seed`` and place them in the flat buffers."""
        ...

    def attach(self, comm: Any) -> None:
        """Hand the layers the communicator of the ranks that hold this model."""
        ...

    def forward(self, x: Array, ctx: Context) -> Array:
        """The logits of a batch."""
        ...

    def predict(self, x: Array) -> Array:
        """The logits of ``x`` in evaluation mode."""
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

    def named_params(self) -> dict[str, Array]:
        """Stable names (``layer0.W``) -> parameter views: what is saved."""
        ...

    def named_views(self, flat: Array) -> dict[str, Array]:
        """The same names -> views of ``flat``, a buffer laid out as ``params`` (gradients)."""
        ...

    def param_names(self) -> list[tuple[str, Layer, str]]:
        """(stable name, layer, the layer's own name) for every parameter, in order."""
        ...

    def summary(self) -> str:
        """One line: the layers and the parameter count."""
        ...
