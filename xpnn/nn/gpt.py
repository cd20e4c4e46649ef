"""A character-level GPT: embeddings, pre-LayerNorm transformer blocks, a LayerNorm, a head."""

from typing import Any

from xpnn.nn.attention import CausalSelfAttention, FeedForward
from xpnn.nn.composite import Chain, Residual
from xpnn.nn.dense import Dense
from xpnn.nn.embedding import Embedding, PositionEmbedding
from xpnn.nn.layer import Array, check_int
from xpnn.nn.norm import LayerNorm
from xpnn.nn.sequential import Sequential

GPT_DEFAULTS = {"layers": 4, "heads": 4, "embed": 128, "block": 64}


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
