"""What a model is (``Model``), and models by name: presets, a user's ``FILE.py:FUNCTION``."""

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from xpnn.errors import UserError
from xpnn.nn.conv import Conv2D
from xpnn.nn.dense import Dense, Flatten
from xpnn.nn.dropout import Dropout
from xpnn.nn.gpt import gpt
from xpnn.nn.layer import Array, Context, Layer
from xpnn.nn.pool import MaxPool2D
from xpnn.nn.sequential import Ready, Sequential


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


MODELS = ("mlp", "cnn", "gpt")
HIDDEN = (512, 256)  # the MLP's default hidden layers
MLP_ACTIVATIONS = ("relu", "sigmoid", "tanh")  # the hidden layers' choices


def mlp(
    hidden: tuple[int, ...] = HIDDEN,
    activation: str = "relu",
    num_classes: int = 10,
    loss: str = "softmax_cross_entropy",
) -> Sequential:
    """Flatten, then Dense layers with fused activations, then a linear output layer."""
    layers = [Flatten(), *(Dense(h, activation) for h in hidden), Dense(num_classes)]
    return Sequential(layers, loss)


def cnn(
    num_classes: int = 10,
    channels: tuple[int, ...] = (32, 128, 256),
    dense: tuple[int, ...] = (1000, 100),
    dropout: float = 0.5,
    loss: str = "softmax_cross_entropy",
) -> Sequential:
    """The MPI deep-learning report's CNN: 690,590 parameters on 1x28x28 inputs."""
    layers = [m for c in channels for m in (Conv2D(c, 3, activation="relu"), MaxPool2D(2))]
    layers += [Flatten(), Dropout(dropout), *(Dense(d, "relu") for d in dense), Dense(num_classes)]
    return Sequential(layers, loss)


def model_name(model: Any) -> str:
    """How a run's ``model`` is shown and compared between ranks: a preset, path or name."""
    return model if isinstance(model, str) else getattr(model, "__qualname__", type(model).__name__)


def load_factory(where: str) -> Callable[[tuple[int, ...], int], Any]:
    source, sep, name = where.rpartition(":")
    if not sep or not source or not name.isidentifier():
        forms = f"{', '.join(MODELS)}, FILE.py:FUNCTION or package.module:FUNCTION"
        raise UserError(f"`model` {where}: expected {forms}")
    if source.endswith(".py"):
        path = Path(source)
        if not path.is_file():
            raise UserError(f"`model` {where}: no file {source}")
        module_name = f"xpnn_user_model_{path.stem}"
        spec = importlib.util.spec_from_file_location(module_name, path)  # .py: never None
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules[module_name] = module  # dataclasses and pickling look the module up
        _import(where, lambda: spec.loader.exec_module(module))  # type: ignore[union-attr]
    else:
        module = _import(where, lambda: importlib.import_module(source))
    factory = getattr(module, name, None)
    if not callable(factory):
        raise UserError(f"`model` {where}: {source} has no function {name}")
    return factory


def check_fits(model: Any, what: str, labels: tuple[int, ...], num_classes: int) -> None:
    """Refuse a model whose per-sample output cannot be scored against the data's."""
    if not model.layers:
        raise UserError(f"`model` {what}: has no layers")
    want, output = (*labels, num_classes), tuple(model.output_shape)
    if output != want:
        per = f" at each of {labels[0]} positions" if labels else ""
        raise UserError(
            f"`model` {what}: gives outputs of shape {output} a sample; the data needs "
            f"{want}: a score for each of its {num_classes} classes{per} (a last layer such as "
            f"Dense({num_classes}))"
        )


def _import(where: str, load: Callable[[], Any]) -> Any:
    """The user's module loaded; its own failure is one line naming it, not a traceback."""
    try:
        return load()
    except SystemExit as exc:  # on one rank only, the others would wait for it
        raise UserError(f"`model` {where}: importing it called sys.exit({exc.code!r})") from None
    except ModuleNotFoundError as exc:
        raise UserError(f"`model` {where}: no module {exc.name}") from None
    except Exception as exc:  # noqa: BLE001 -- the user's code: any error is theirs to see
        said = f"importing it raised {type(exc).__name__}: {exc}"
        raise UserError(f"`model` {where}: {said}") from None


def build_model(
    model: Any,
    hidden: tuple[int, ...] = HIDDEN,
    activation: str = "relu",
    num_classes: int = 10,
    loss: str = "softmax_cross_entropy",
    input_shape: tuple[int, ...] = (1, 28, 28),
    gpt_sizes: dict[str, int] | None = None,
) -> Sequential:
    """The unbuilt model a run's ``model`` names, makes or is (``num_classes``: gpt's vocab)."""
    if model == "mlp":
        return mlp(hidden, activation, num_classes, loss)
    if model == "cnn":
        if tuple(input_shape) != (1, 28, 28):
            raise UserError(f"`model` cnn: needs 1x28x28 images, the data has {input_shape}")
        return cnn(num_classes, loss=loss)
    if model == "gpt":
        return gpt(num_classes, **(gpt_sizes or {}))
    what = model_name(model)
    if isinstance(model, str):
        model = load_factory(model)
    if callable(model):
        try:
            model = model(tuple(input_shape), num_classes)
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 -- the user's factory
            raise UserError(f"`model` {what}: it raised {type(exc).__name__}: {exc}") from None
    check_model(model, what)
    return model
