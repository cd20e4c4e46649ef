"""A model of your own for the command line: library layers around ``PReLU`` from
``own_layer.py`` (beside this file). Train it on one rank or several:

    python -m xpnn --model examples/own_model.py:build --dataset synthetic --epochs 3
    mpiexec -n 2 python -m xpnn --model examples/own_model.py:build --dataset synthetic

``build(input_shape, num_classes)`` is called on every rank with the data set's sample shape
and class count; the runner builds what it returns."""

from __future__ import annotations

import sys
from pathlib import Path

from xpnn.nn import Dense, Flatten, LayerNorm, Residual, Sequential

sys.path.insert(0, str(Path(__file__).resolve().parent))  # own_layer.py, from any directory
from own_layer import PReLU  # noqa: E402


def build(input_shape, num_classes, width=64):
    """Flatten, a Dense layer with PReLU, a residual block, then the class scores; saved as
    ``layer0.W``, ``layer1.alpha``, ``layer2.0.gamma`` (the block's LayerNorm), ..."""
    return Sequential(
        [
            Flatten(),
            Dense(width),
            PReLU(),
            Residual([LayerNorm(), Dense(width), PReLU()]),
            Dense(num_classes),
        ]
    )
