"""Layers, losses and models, written once against ``backend.xp``."""

from xpnn.nn.conv import Conv2D
from xpnn.nn.dense import GELU, Dense, Flatten, ReLU, Sigmoid, Tanh
from xpnn.nn.dropout import Dropout
from xpnn.nn.gpt import (
    CausalSelfAttention,
    Embedding,
    FeedForward,
    LayerNorm,
    PositionEmbedding,
    SequenceCrossEntropy,
    TransformerBlock,
    gpt,
    transformer_block,
)
from xpnn.nn.layer import Chain, Context, Layer, Residual
from xpnn.nn.losses import SigmoidBinaryCrossEntropy, SoftmaxCrossEntropy
from xpnn.nn.models import Model, build_model, cnn, mlp
from xpnn.nn.pool import MaxPool2D
from xpnn.nn.sequential import LayerError, Sequential

__all__ = ["Context", "Dense", "Flatten", "Layer", "Model", "ReLU", "Sequential", "Sigmoid"]
__all__ += ["LayerError", "Tanh", "SigmoidBinaryCrossEntropy", "SoftmaxCrossEntropy", "build_model"]
__all__ += ["cnn", "mlp", "CausalSelfAttention", "Chain", "Embedding", "FeedForward", "GELU"]
__all__ += ["LayerNorm", "PositionEmbedding", "Residual", "SequenceCrossEntropy"]
__all__ += ["TransformerBlock", "gpt", "transformer_block", "Conv2D", "Dropout", "MaxPool2D"]
