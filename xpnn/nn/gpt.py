"""A character-level GPT and its layers: embeddings, LayerNorm, attention, transformer blocks."""

import math
from typing import Any

from xpnn.nn.dense import Dense
from xpnn.nn.layer import Array, Chain, Context, Layer, Residual, check_int
from xpnn.nn.sequential import Sequential

GPT_DEFAULTS = {"layers": 4, "heads": 4, "embed": 128, "block": 64}
EMBEDDING_STD = 0.02  # GPT-2's initial scale for token and position vectors


class LayerNorm(Layer):
    """``y = gamma * (x - mean) / sqrt(var + eps) + beta`` over the last axis (Ba et al., 2016)."""

    def __init__(self, eps: float = 1e-5) -> None:
        super().__init__()
        if not eps > 0:
            raise ValueError(f"LayerNorm: eps must be > 0, got {eps!r}")
        self.eps = float(eps)

    def setup(self, in_shape: tuple[int, ...], rng: Any) -> tuple[int, ...]:
        if len(in_shape) < 1:
            raise ValueError(f"LayerNorm expects inputs with a feature axis, got shape {in_shape}")
        self.add_param("gamma", 1.0, (in_shape[-1],))
        self.add_param("beta", 0.0, (in_shape[-1],))
        return in_shape

    def forward(self, x: Array, ctx: Context) -> Array:
        gamma, beta = self.params["gamma"], self.params["beta"]
        if x.dtype != gamma.dtype:
            x = self.xp.asarray(x, dtype=gamma.dtype)
        y, self.xhat, self.inv_std = self.kernels.layer_norm(x, gamma, beta, self.eps)
        return y

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        dx, dgamma, dbeta = self.kernels.layer_norm_backward(
            dy, self.xhat, self.inv_std, self.params["gamma"], need_dx
        )
        self.grads["gamma"][...] = dgamma
        self.grads["beta"][...] = dbeta
        return dx


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
        return xp.reshape(xp.take(self.params["W"], ids, axis=0), (*self.shape, self.dim))

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        dy = self.xp.reshape(dy, (self.ids.shape[0], self.dim))
        self.kernels.embedding_grad(self.ids, dy, self.grads["W"])  # ids have no gradient


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


class CausalSelfAttention(Chain):
    """(B, T, D) -> (B, T, D), position ``i`` attending to ``<= i``; ``proj`` mixes the heads."""

    def __init__(self, embed: int, heads: int) -> None:
        owner = "CausalSelfAttention"
        self.embed = check_int(owner, "embed", embed)
        self.heads = check_int(owner, "heads", heads)
        if embed % heads:
            raise ValueError(f"{owner}: embed {embed} is not a multiple of heads {heads}")
        self.head_dim = embed // heads
        self.scale = 1.0 / math.sqrt(self.head_dim)  # of the scores q k^T
        # qkv's columns: (head, q/k/v, head dim), so that a range of heads is one slice (Megatron)
        super().__init__({"qkv": Dense(3 * embed), "proj": Dense(embed)})
        self.tensor_pairs = (("qkv", "proj", 3 * self.head_dim, self.head_dim),)

    def setup(self, in_shape: tuple[int, ...], rng: Any) -> tuple[int, ...]:
        if len(in_shape) != 2 or in_shape[1] != self.embed:
            raise ValueError(f"{self!r} expects (T, {self.embed}) inputs, got shape {in_shape}")
        self.build_child("qkv", in_shape, rng)
        return self.build_child("proj", in_shape, rng)  # it reads the heads' merged outputs

    def forward(self, x: Array, ctx: Context) -> Array:
        xp = self.xp
        qkv = self.children["qkv"].forward(x, ctx)
        b, t, width = qkv.shape
        heads = width // (3 * self.head_dim)  # this rank's heads under tensor parallelism
        split = xp.reshape(qkv, (b, t, heads, 3, self.head_dim))
        q, k, v = (split[:, :, :, i, :] for i in range(3))
        self.q, self.k, self.v = (xp.permute_dims(a, (0, 2, 1, 3)) for a in (q, k, v))
        merged = xp.empty((b, t, heads * self.head_dim), dtype=qkv.dtype)  # heads side by side
        out = xp.permute_dims(xp.reshape(merged, (b, t, heads, self.head_dim)), (0, 2, 1, 3))
        _, self.p = self.kernels.causal_attention(self.q, self.k, self.v, self.scale, out=out)
        return self.children["proj"].forward(merged, ctx)

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        xp = self.xp
        dmerged = self.children["proj"].backward(dy, need_dx=True)
        b, heads, t, hd = self.q.shape
        dout = xp.permute_dims(xp.reshape(dmerged, (b, t, heads, hd)), (0, 2, 1, 3))
        dqkv = xp.empty((b, t, heads, 3, hd), dtype=dout.dtype)  # qkv's column layout
        out = tuple(xp.permute_dims(dqkv[:, :, :, i, :], (0, 2, 1, 3)) for i in range(3))
        self.kernels.causal_attention_backward(
            dout, self.q, self.k, self.v, self.p, self.scale, out=out
        )
        return self.children["qkv"].backward(xp.reshape(dqkv, (b, t, 3 * heads * hd)), need_dx)

    def __repr__(self) -> str:
        return f"CausalSelfAttention({self.embed}, {self.heads} heads)"


class FeedForward(Chain):
    """``down(GELU(up(x)))``, GELU fused in ``up``'s bias pass; split by columns, then rows."""

    tensor_pairs = (("up", "down", 1, 1),)

    def __init__(self, embed: int, hidden: int) -> None:
        check_int("FeedForward", "embed", embed)
        check_int("FeedForward", "hidden", hidden)
        super().__init__({"up": Dense(hidden, "gelu"), "down": Dense(embed)})


class SequenceCrossEntropy:
    """Softmax cross-entropy at each of T positions, a sample's loss their mean: nats per token."""

    name = "sequence_cross_entropy"

    def __call__(self, kernels: Any, logits: Array, labels: Array, scale: float):  # noqa: ANN204
        xp = kernels.xp
        n, t, v = logits.shape
        flat = xp.reshape(logits, (n * t, v))
        loss, grad = kernels.softmax_cross_entropy(flat, xp.reshape(labels, (n * t,)), scale / t)
        return loss / t, xp.reshape(grad, (n, t, v))


class TransformerBlock(Chain):
    """Pre-LayerNorm: ``x + attn(ln(x))``, then ``x + ff(ln(x))`` with a 4x wider hidden layer."""

    def __init__(self, embed: int, heads: int) -> None:
        attn = Residual({"ln": LayerNorm(), "sa": CausalSelfAttention(embed, heads)})
        mlp = Residual({"ln": LayerNorm(), "ff": FeedForward(embed, 4 * embed)})
        super().__init__({"attn": attn, "mlp": mlp})
        self.embed, self.heads = embed, heads

    def __repr__(self) -> str:
        return f"TransformerBlock({self.embed}, {self.heads} heads)"


transformer_block = TransformerBlock  # the name model-api.md gives a GPT block


def gpt(
    vocab: int,
    layers: int = GPT_DEFAULTS["layers"],
    heads: int = GPT_DEFAULTS["heads"],
    embed: int = GPT_DEFAULTS["embed"],
    block: int = GPT_DEFAULTS["block"],
) -> Sequential:
    """Ids (N, block) -> logits (N, block, vocab); each block a layer: pipeline stages cut there."""
    check_int("gpt", "layers", layers)  # vocab: Embedding checks it
    seq = [Embedding(vocab, embed), PositionEmbedding(check_int("gpt", "block", block))]
    seq += [transformer_block(embed, heads) for _ in range(layers)]
    seq += [LayerNorm(), Dense(vocab)]
    return Sequential(seq, SequenceCrossEntropy())
