"""``python -m xpnn generate CHECKPOINT``: sample text from a GPT checkpoint, on any backend."""

import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from xpnn.backends import BACKENDS, get_backend
from xpnn.commands.flags import Parser
from xpnn.errors import UserError
from xpnn.nn.gpt import GPT_DEFAULTS, gpt
from xpnn.nn.layer import Context
from xpnn.train import checkpoint
from xpnn.train.checkpoint import damaged


def model_from_checkpoint(path: str | Path, backend_name: str = "numpy") -> tuple[Any, str]:
    """(the GPT of checkpoint ``path`` or a directory's latest, its vocabulary); damage refused."""
    if (path := Path(path)).is_dir():
        if (latest := checkpoint.latest_checkpoint(path)) is None:
            raise UserError(f"{path}: a directory without checkpoints")
        path = latest
    try:
        arrays = checkpoint.read_npz(path)
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    sizes, vocab = _gpt_identity(path, arrays)
    if (first := arrays.get("layer0.W")) is None or first.dtype.kind != "f":
        raise damaged(path, "layer0.W missing or not floating point")
    backend = get_backend(backend_name, str(first.dtype))
    model = gpt(len(vocab), **sizes).build((sizes["block"],), backend, 0)
    params = model.named_params()
    for name, view in params.items():
        if (stored := arrays.get(name)) is None or stored.shape != tuple(view.shape):
            why = f"parameter {name} missing or of another shape than meta.identity's sizes make"
            raise damaged(path, why)
        if stored.dtype.kind != "f":
            raise damaged(path, f"{name} holds {stored.dtype} values, not floating point")
    checkpoint.check_finite(path, {name: arrays[name] for name in params})
    for name, view in params.items():
        view[...] = backend.asarray(arrays[name], dtype=view.dtype)
    return model, vocab


def _gpt_identity(path: Path, arrays: dict[str, Any]) -> tuple[dict[str, int], str]:
    """``meta.identity``'s sizes and vocabulary, checked against what the file holds: sizes no
    parameters of the file could fill would fill memory."""
    identity = checkpoint._json_meta(path, arrays, "identity")
    if identity.get("model") != "gpt":
        raise UserError(f"{path}: not a checkpoint of `--model gpt` (nothing to sample from)")
    sizes, vocab = {}, identity.get("vocab")
    for name in GPT_DEFAULTS:
        if not isinstance(value := identity.get(name), int) or isinstance(value, bool) or value < 1:
            raise damaged(path, f"meta.identity's {name} is {value!r}")
        sizes[name] = value
    if not isinstance(vocab, str) or not vocab:
        raise damaged(path, f"meta.identity's vocab is {vocab!r}")
    embed = sizes["embed"]
    stored = sum(int(v.size) for k, v in arrays.items() if not k.startswith("meta."))
    least = embed * (len(vocab) + sizes["block"] + sizes["layers"] * embed)  # embeddings, blocks
    if embed % sizes["heads"] or least > stored:
        why = f"meta.identity's sizes {sizes} and vocabulary of {len(vocab)} need more than the "
        why += f"{stored:,} values the file holds, or `heads` does not divide `embed`"
        raise damaged(path, why)
    return sizes, vocab


def sample(
    model: Any, vocab: str, chars: int, temperature: float = 1.0, seed: int = 0, prompt: str = "\n"
) -> str:
    """``chars`` characters after ``prompt``, each from the softmax of logits / ``temperature``."""
    index = {c: i for i, c in enumerate(vocab)}
    if unknown := sorted(set(prompt) - index.keys()):
        raise UserError(f"prompt: characters the model never saw: {''.join(unknown)!r}")
    ids = [index[c] for c in prompt] or [0]
    start, block = len(ids), model.shapes[0][0]
    rng = np.random.default_rng(seed)
    backend = model.backend
    for _ in range(chars):
        context = np.asarray(ids[-block:], dtype=np.int64)[None, :]
        logits = model.forward(backend.asarray(context, dtype=backend.xp.int64), Context())
        last = backend.to_host(logits[0, -1, :]).astype(np.float64) / temperature
        p = np.exp(last - last.max())
        ids.append(int(rng.choice(len(vocab), p=p / p.sum())))
    return "".join(vocab[i] for i in ids[start:])


MOST_CHARS = 1_000_000  # a forward pass each: more is hours, and a typo's 10**20 never ends


def main(argv: list[str]) -> int:
    p = Parser(
        prog="python -m xpnn generate",
        description="Sample text from a --model gpt checkpoint (a file of --checkpoint-dir).",
    )
    add = p.add_argument
    add("checkpoint", help="a checkpoint-epochNNNN.npz file, or its directory")
    add("--chars", type=int, default=500, help="characters to write (default 500)")
    add("--temperature", type=float, default=1.0, help="> 0; lower is safer (1.0)")
    add("--seed", type=int, default=0, help="the draws' seed (default 0)")
    add("--prompt", default="\n", help="text to continue (default a newline)")
    add("--backend", choices=BACKENDS, default="numpy", help="(numpy)")
    try:
        args = p.parse_args(argv)
        if not 0 <= args.chars <= MOST_CHARS:
            raise UserError(f"--chars: must be 0 to {MOST_CHARS:,}, got {args.chars}")
        if not 0 <= args.seed <= 2**64 - 1:  # as training's --seed
            raise UserError(f"--seed: must be 0 to 2**64 - 1, got {args.seed}")
        if not (math.isfinite(args.temperature) and args.temperature > 0):
            raise UserError(f"--temperature: must be > 0 and finite, got {args.temperature}")
        model, vocab = model_from_checkpoint(args.checkpoint, args.backend)
        text = sample(model, vocab, args.chars, args.temperature, args.seed, args.prompt)
    except UserError as exc:
        print(f"xpnn generate: {exc}".replace("prompt:", "--prompt:"), file=sys.stderr)
        return 2
    print(args.prompt + text if args.prompt != "\n" else text)
    return 0
