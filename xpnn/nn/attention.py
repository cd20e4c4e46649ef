"""Self-attention and the feed-forward block: Dense composites that declare ``tensor_pairs``."""

import math
from typing import Any

from xpnn.nn.composite import Chain
from xpnn.nn.dense import Dense
from xpnn.nn.layer import Array, Context, check_int


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
            raise ValueError(
                f"CausalSelfAttention({self.embed}) expects (T, {self.embed}) inputs, "
                f"got shape {in_shape}"
            )
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
