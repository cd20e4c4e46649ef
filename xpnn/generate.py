"""``python -m xpnn generate CHECKPOINT --chars N --temperature T --seed S``: sample text from a
GPT checkpoint (``--checkpoint-dir``'s files), on any backend."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from xpnn.backends import BACKENDS
from xpnn.errors import UserError


def model_from_checkpoint(path: str, backend_name: str = "numpy") -> tuple[Any, str]:
    """(the GPT of checkpoint ``path`` (a file, or a directory's latest), built on the backend
    ``backend_name`` in the checkpoint's precision with its parameters; its vocabulary)."""
    from xpnn.backends import get_backend
    from xpnn.checkpoint import DamagedCheckpoint, latest_checkpoint, read_npz
    from xpnn.nn.gpt import GPT_DEFAULTS, gpt

    if Path(path).is_dir():
        latest = latest_checkpoint(path)
        if latest is None:
            raise UserError(f"{path}: a directory without checkpoints")
        path = str(latest)
    try:
        arrays = read_npz(path)
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except DamagedCheckpoint as exc:
        raise UserError(str(exc)) from None
    identity = json.loads(str(arrays.get("meta.identity", "{}")))
    if identity.get("model") != "gpt":
        raise UserError(f"{path}: not a checkpoint of `--model gpt` (nothing to sample from)")
    sizes = {name: int(identity[name]) for name in GPT_DEFAULTS}
    vocab = str(identity["vocab"])
    backend = get_backend(backend_name, str(arrays["layer0.W"].dtype))
    model = gpt(len(vocab), **sizes).build((sizes["block"],), backend, 0)
    for name, view in model.named_params().items():
        view[...] = backend.asarray(arrays[name])
    return model, vocab


def sample(
    model: Any,
    vocab: str,
    chars: int,
    temperature: float = 1.0,
    seed: int = 0,
    prompt: str = "\n",
) -> str:
    """``chars`` characters after ``prompt``, each drawn from the softmax of the last position's
    logits divided by ``temperature``, over at most the model's ``block`` latest characters."""
    from xpnn.nn.layer import Context

    if temperature <= 0:
        raise UserError(f"temperature: must be > 0, got {temperature}")
    index = {c: i for i, c in enumerate(vocab)}
    unknown = sorted(set(prompt) - index.keys())
    if unknown:
        raise UserError(f"prompt: characters the model never saw: {''.join(unknown)!r}")
    ids = [index[c] for c in prompt] or [0]
    block = model.shapes[0][0]
    rng = np.random.default_rng(seed)
    backend = model.backend
    out = []
    for _ in range(chars):
        context = np.asarray(ids[-block:], dtype=np.int64)[None, :]
        logits = model.forward(backend.asarray(context, dtype=backend.xp.int64), Context())
        last = backend.to_host(logits[0, -1, :]).astype(np.float64) / temperature
        p = np.exp(last - last.max())
        nxt = int(rng.choice(len(vocab), p=p / p.sum()))
        ids.append(nxt)
        out.append(vocab[nxt])
    return "".join(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m xpnn generate",
        description="Sample text from a --model gpt checkpoint (a file of --checkpoint-dir).",
        allow_abbrev=False,
    )
    p.add_argument("checkpoint", help="a checkpoint-epochNNNN.npz file, or its directory")
    p.add_argument("--chars", type=int, default=500, help="characters to write (default 500)")
    p.add_argument("--temperature", type=float, default=1.0, help="> 0; lower is safer (1.0)")
    p.add_argument("--seed", type=int, default=0, help="the draws' seed (default 0)")
    p.add_argument("--prompt", default="\n", help="text to continue (default a newline)")
    p.add_argument("--backend", choices=BACKENDS, default="numpy", help="(numpy)")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.chars < 0:
            raise UserError(f"--chars: must be >= 0, got {args.chars}")
        if args.seed < 0:
            raise UserError(f"--seed: must be >= 0, got {args.seed}")
        model, vocab = model_from_checkpoint(args.checkpoint, args.backend)
        temperature = args.temperature
        if not temperature > 0:
            raise UserError(f"--temperature: must be > 0, got {temperature}")
        text = sample(model, vocab, args.chars, temperature, args.seed, args.prompt)
    except UserError as exc:
        print(f"xpnn generate: {exc}".replace("prompt:", "--prompt:"), file=sys.stderr)
        return 2
    print(args.prompt + text if args.prompt != "\n" else text)
    return 0
