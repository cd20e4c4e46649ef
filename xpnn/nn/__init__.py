"""Layers, losses and models, written once against ``backend.xp``."""

from xpnn.nn.activations import ReLU, Sigmoid, Tanh
from xpnn.nn.dense import Dense
from xpnn.nn.flatten import Flatten
from xpnn.nn.layer import Context, Layer
from xpnn.nn.losses import SigmoidBinaryCrossEntropy, SoftmaxCrossEntropy
from xpnn.nn.model import Model
from xpnn.nn.models import build_model, cnn, mlp
from xpnn.nn.sequential import Sequential

__all__ = ["Context", "Dense", "Flatten", "Layer", "Model", "ReLU", "Sequential", "Sigmoid"]
__all__ += ["Tanh"]
__all__ += ["SigmoidBinaryCrossEntropy", "SoftmaxCrossEntropy", "build_model", "cnn", "mlp"]
