"""Losses: return the *sum* over the batch (ranks add them exactly) and the scaled gradient."""

from typing import Any

Array = Any


class SoftmaxCrossEntropy:
    name = "softmax_cross_entropy"

    def __call__(self, kernels: Any, logits: Array, labels: Array, scale: float):  # noqa: ANN204
        return kernels.softmax_cross_entropy(logits, labels, scale)


class SigmoidBinaryCrossEntropy:
    """The seed reports' cost: one sigmoid per class against one-hot targets."""

    name = "sigmoid_bce"

    def __call__(self, kernels: Any, logits: Array, labels: Array, scale: float):  # noqa: ANN204
        return kernels.sigmoid_binary_cross_entropy(logits, labels, scale)


LOSSES = {cls.name: cls for cls in (SoftmaxCrossEntropy, SigmoidBinaryCrossEntropy)}
