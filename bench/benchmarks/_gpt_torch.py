"""A native ``torch.nn`` GPT trained as ``--model gpt`` trains (``python -m
bench.benchmarks._gpt_torch --text FILE``): the same architecture (token and position
embeddings, pre-LayerNorm blocks of causal self-attention with a fused QKV projection and a 4x
tanh-GELU MLP, a final LayerNorm, a vocabulary head), the same recipe (AdamW 0.9, 0.95, eps
1e-8, weight decay 0.1 on matrices, warmup then cosine, clipping at 1.0) on random windows of
the same text. Prints one JSON line: tokens/s over the timed steps and the peak RSS."""

from __future__ import annotations

import argparse
import json
import math
import resource
import time

import numpy as np

from bench.flags import nonneg_int, positive_int


def build(vocab: int, layers: int, heads: int, embed: int, block: int):  # noqa: ANN201
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.proj = nn.Linear(embed, 3 * embed), nn.Linear(embed, embed)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, d = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # nanoGPT's choice
            return self.proj(y.transpose(1, 2).reshape(b, t, d))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.attn, self.ln2 = nn.LayerNorm(embed), Attention(), nn.LayerNorm(embed)
            self.mlp = nn.Sequential(
                nn.Linear(embed, 4 * embed), nn.GELU("tanh"), nn.Linear(4 * embed, embed)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, embed), nn.Embedding(block, embed)
            self.blocks = nn.Sequential(*[Block() for _ in range(layers)])
            self.ln, self.head = nn.LayerNorm(embed), nn.Linear(embed, vocab)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(idx.shape[1])
            return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))

    return GPT()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--text", required=True)
    p.add_argument("--steps", type=positive_int, default=50)
    p.add_argument("--warmup", type=nonneg_int, default=5)
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--batch", type=positive_int, default=32)
    p.add_argument("--layers", type=positive_int, default=4)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--embed", type=positive_int, default=128)
    p.add_argument("--block", type=positive_int, default=64)
    p.add_argument("--seed", type=nonneg_int, default=0)
    args = p.parse_args()
    import torch
    from torch.nn import functional as F

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    text = open(args.text, encoding="utf-8").read()  # noqa: SIM115
    chars = sorted(set(text))
    ids = np.array([chars.index(c) for c in text[: int(len(text) * 0.9)]], dtype=np.int64)
    stream = torch.from_numpy(ids)
    model = build(len(chars), args.layers, args.heads, args.embed, args.block)
    params = sum(p.numel() for p in model.parameters())
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    total = args.warmup + args.steps

    def rate(step: int) -> float:  # warmup 100 then cosine to a tenth, as the xpnn preset
        if step < 100:
            return (step + 1) / 100
        frac = min((step - 100) / max(total - 100, 1), 1.0)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, rate)
    rng = np.random.default_rng(args.seed)
    offsets = torch.arange(args.block)

    def step() -> None:
        starts = torch.from_numpy(rng.integers(0, len(ids) - args.block, size=args.batch))
        at = starts[:, None] + offsets
        x, y = stream[at], stream[at + 1]
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()

    for _ in range(args.warmup):
        step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    tokens = args.steps * args.batch * args.block
    out = {"tokens_per_s": tokens / seconds, "peak_rss_mb": peak, "params": params}
    out |= {"torch": torch.__version__, "threads": torch.get_num_threads()}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
