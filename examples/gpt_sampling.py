"""A small GPT on a small text, then sampling from it: train a character-level transformer
for a few hundred steps on a text of your own (a rhyme here, written to a temporary file),
save a checkpoint, and sample from it as ``python -m xpnn generate`` does:

    python examples/gpt_sampling.py
    python examples/gpt_sampling.py --text my.txt --steps 1000

The command line does the same with ``python -m xpnn --model gpt --dataset text --data-dir
my.txt --checkpoint-dir ck`` and then ``python -m xpnn generate ck``."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from xpnn.commands.generate import model_from_checkpoint, sample
from xpnn.run import RunSpec, build_run
from xpnn.runtime import init_world

RHYME = """Twinkle, twinkle, little star,
How I wonder what you are!
Up above the world so high,
Like a diamond in the sky.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", type=Path, help="a UTF-8 file (default: a rhyme, 8 times)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--chars", type=int, default=120, help="characters to sample")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        text = args.text or Path(tmp) / "rhyme.txt"
        if args.text is None:
            text.write_text(RHYME * 8)
        spec = RunSpec(
            model="gpt", dataset="text", data_dir=str(text),
            layers=2, heads=2, embed=32, block=32,  # tiny: seconds on a laptop's CPU
            steps=args.steps, eval_every=args.steps, batch_size=16, lr=3e-3,
            threads=1,  # a model this small runs fastest on one thread
            checkpoint_dir=str(Path(tmp) / "ck"), progress=False,
        )  # fmt: skip
        trainer = build_run(spec, init_world(), log=lambda line: None)
        result = trainer.run()
        model, vocab = model_from_checkpoint(spec.checkpoint_dir)
    print(f"after {args.steps} steps: {result['val_loss']:.3f} nats a character")
    print(sample(model, vocab, args.chars, temperature=0.8, seed=1, prompt="Twinkle"))


if __name__ == "__main__":
    main()
