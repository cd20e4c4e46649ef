"""Learned embeddings: token vectors gathered by index, and position vectors added."""

import math
from typing import Any

from xpnn.nn.layer import Array, Context, Layer, check_int

EMBEDDING_STD = 0.02  # GPT-2's initial scale for token and position vectors


class Embedding(Layer):
    """Integer ids (any shape) -> rows of ``W`` (``vocab``, ``dim``); ids have no gradient."""

    repr_attrs = ("vocab", "dim")

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.vocab = check_int("Embedding", "vocab", vocab)
        self.dim = check_int("Embedding", "dim", dim)

    def setup(self, in_shape: tuple[int, ...], rng: Any) -> tuple[int, ...]:
        self.add_param("W", rng.standard_normal((self.vocab, self.dim)) * EMBEDDING_STD)
        return (*in_shape, self.dim)

    def forward(self, x: Array, ctx: Context) -> Array:
        xp = self.xp
        ids = xp.reshape(x, (math.prod(x.shape),))
        if ids.dtype != xp.int64:  # ids may arrive as floats from a generic batch path
            ids = xp.astype(ids, xp.int64)
        self.ids, self.shape = ids, tuple(x.shape)
        rows = xp.take(self.params["W"], ids, axis=0)
        return xp.reshape(rows, (*self.shape, self.dim))

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        dy = self.xp.reshape(dy, (self.ids.shape[0], self.dim))
        self.kernels.embedding_grad(self.ids, dy, self.grads["W"])
        return None


class PositionEmbedding(Layer):
    """``y = x + W[:T]`` on (B, T, D) inputs; T below ``max_len`` in generation's first steps."""

    repr_attrs = ("max_len",)

    def __init__(self, max_len: int) -> None:
        super().__init__()
        self.max_len = check_int("PositionEmbedding", "max_len", max_len)

    def setup(self, in_shape: tuple[int, ...], rng: Any) -> tuple[int, ...]:
        if len(in_shape) != 2 or in_shape[0] > self.max_len:
            want = f"(T, D) inputs with T <= {self.max_len}"
            raise ValueError(f"{self!r} expects {want}, got shape {in_shape}")
        self.add_param("W", rng.standard_normal((self.max_len, in_shape[1])) * EMBEDDING_STD)
        return in_shape

    def forward(self, x: Array, ctx: Context) -> Array:
        self.length = x.shape[1]
        return x + self.params["W"][: self.length, :]

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        grad = self.grads["W"]
        grad[...] = 0
        grad[: self.length, :] = self.xp.sum(dy, axis=0)
        return dy if need_dx else None
