"""What runs ask of a model (``Model``), and strategies that swap layers (``LayeredModel``)."""

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from xpnn.errors import UserError
from xpnn.nn.layer import Array, Context, Layer

Ready = Callable[[int], None] | None  # on_grads_ready(offset): ``grads[offset:]`` is final


@runtime_checkable
class Model(Protocol):
    """A built network whose parameters and gradients are two flat buffers of ``size``."""

    params: Array  # every parameter, one flat buffer on the backend
    grads: Array  # their gradients, laid out as ``params``
    size: int  # the parameters this rank holds
    backend: Any  # where the buffers live (``xp``, ``kernels``, ``to_host``)
    layer_offsets: list[int]  # where backward may report ``grads[offset:]`` final ([0]: at end)

    # draw the initial weights from ``seed`` and place them in the flat buffers
    def build(self, input_shape: tuple[int, ...], backend: Any, seed: int) -> "Model": ...
    # move the parameters into ``params`` (copied if ``copy``), the gradients to ``grads``
    def adopt(self, params: Array, grads: Array, copy: bool = True) -> None: ...
    # forward, loss and backward: (loss sum, correct count); ``grads`` assigned, scaled
    def loss_and_grads(
        self, x: Array, labels: Array, ctx: Context, scale: float, on_grads_ready: Ready = None
    ) -> tuple[Array, Array]: ...
    # (loss sum, correct count) in evaluation mode
    def evaluate(self, x: Array, labels: Array) -> tuple[Array, Array]: ...
    # stable names -> views of ``flat``, a buffer laid out as ``params``: what is saved
    def named_views(self, flat: Array) -> dict[str, Array]: ...
    def summary(self) -> str: ...  # one line: the network and its parameter count


METHODS = tuple(name for name, v in vars(Model).items() if callable(v) and name[0] != "_")
BUILT = tuple(Model.__annotations__)  # the attributes ``build`` sets


def check_model(model: Any, what: str, built: bool = False) -> None:
    """Refuse `model` ``what`` lacking a method of the protocol, or (``built``) an attribute."""
    has = hasattr if built else lambda m, name: callable(getattr(m, name, None))
    missing = ", ".join(name for name in (BUILT if built else METHODS) if not has(model, name))
    if missing:
        kind = f"gave {type(model).__name__}, not an xpnn.nn.Sequential nor an xpnn.nn.Model"
        raise UserError(f"`model` {what}: {'built' if built else kind}: it lacks {missing}")


@runtime_checkable
class LayeredModel(Protocol):
    """What a ``Model`` of layers in order offers the strategies that swap or stage them."""

    layers: list[Layer]  # in order, each with its named parameters and gradients
    output_shape: tuple[int, ...]  # a sample's logits

    def attach(self, comm: Any) -> None: ...  # the communicator of the ranks holding it
    # (stable name, layer, the layer's own name) for every parameter, in order
    def param_names(self) -> list[tuple[str, Layer, str]]: ...
