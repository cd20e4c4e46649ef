"""Model presets: the networks of the seed reports, by name."""

from __future__ import annotations

from xpnn.errors import UserError
from xpnn.nn.dense import Dense
from xpnn.nn.flatten import Flatten
from xpnn.nn.sequential import Sequential, resolve_loss

MODELS = ("mlp", "cnn")


def mlp(
    hidden: tuple[int, ...] = (512, 256),
    activation: str = "relu",
    num_classes: int = 10,
    loss: str = "softmax_cross_entropy",
) -> Sequential:
    """Flatten, then Dense layers with fused activations, then a linear output layer."""
    layers = [Flatten(), *(Dense(h, activation) for h in hidden), Dense(num_classes)]
    return Sequential(layers, resolve_loss(loss))


def cnn(
    num_classes: int = 10,
    channels: tuple[int, ...] = (32, 128, 256),
    dense: tuple[int, ...] = (1000, 100),
    dropout: float = 0.5,
    loss: str = "softmax_cross_entropy",
) -> Sequential:
    """The MPI deep-learning report's CNN: 690,590 parameters on 1x28x28 inputs."""
    from xpnn.nn.conv import Conv2D
    from xpnn.nn.dropout import Dropout
    from xpnn.nn.pool import MaxPool2D

    layers: list = []
    for c in channels:  # ReLU fused into the convolution's bias pass
        layers += [Conv2D(c, 3, activation="relu"), MaxPool2D(2)]
    layers += [Flatten(), Dropout(dropout)]
    layers += [Dense(d, "relu") for d in dense]
    layers.append(Dense(num_classes))
    return Sequential(layers, resolve_loss(loss))


def build_model(
    name: str,
    hidden: tuple[int, ...] = (512, 256),
    activation: str = "relu",
    num_classes: int = 10,
    loss: str = "softmax_cross_entropy",
) -> Sequential:
    if name == "mlp":
        return mlp(hidden, activation, num_classes, loss)
    if name == "cnn":
        return cnn(num_classes, loss=loss)
    raise UserError(f"`model`: unknown model {name!r} (choose {', '.join(MODELS)})")
