"""Character-level text: a sample is a window drawn from (seed, step, sample), alike on N ranks."""

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from xpnn.data.download import default_cache_dir, fetch, mirrors_from, sha256_file
from xpnn.data.files import NotAFile, TooLarge, memory_bytes, read_regular
from xpnn.errors import UserError

TEXT_DATASETS = ("tinyshakespeare", "text")
TEXT_WINDOWS = 32 * 500  # windows an epoch: 500 steps of batch 32
TEXT_BYTES_PER_CHAR = 16  # the bytes, their str, the ids and the split's copies

SHAKESPEARE_FILE = "input.txt"
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
SHAKESPEARE_MIRRORS = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/",
)
SHAKESPEARE_MIRRORS_ENV = "XPNN_TINYSHAKESPEARE_MIRRORS"


@dataclass(frozen=True)
class Vocabulary:
    """The characters a model reads and writes, id ``i`` being ``chars[i]``."""

    chars: str

    def encode(self, text: str) -> np.ndarray:
        index = {c: i for i, c in enumerate(self.chars)}
        if unknown := sorted(set(text) - index.keys()):
            raise UserError(f"text: characters outside the vocabulary: {''.join(unknown)[:20]!r}")
        return np.fromiter((index[c] for c in text), dtype=np.int32, count=len(text))

    def decode(self, ids: np.ndarray) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def shakespeare_path(data_dir: str | os.PathLike | None, download: bool = True) -> Path:
    """``input.txt`` in ``data_dir`` (or that file), else cached; its SHA-256 checked either way."""
    if data_dir is not None:
        path = Path(data_dir)
        if path.is_dir():
            path = path / SHAKESPEARE_FILE
        if not path.is_file():
            raise UserError(f"`data_dir` {data_dir}: no {SHAKESPEARE_FILE} there")
        if sha256_file(path) != SHAKESPEARE_SHA256:
            raise UserError(
                f"`data_dir` {path}: not tiny Shakespeare's {SHAKESPEARE_FILE} (its SHA-256 "
                f"differs; for another text use `dataset` text)"
            )
        return path
    mirrors = mirrors_from(SHAKESPEARE_MIRRORS_ENV, SHAKESPEARE_MIRRORS)
    cache, holding = default_cache_dir() / "tinyshakespeare", f"holding {SHAKESPEARE_FILE}"
    return fetch(
        SHAKESPEARE_FILE, SHAKESPEARE_SHA256, mirrors, cache, download=download, holding=holding
    )


def read_text(path: str | os.PathLike) -> str:
    have = memory_bytes()  # a character becomes an 8-byte id, beside the text itself
    try:
        return read_regular(path, have // TEXT_BYTES_PER_CHAR if have else None).decode("utf-8")
    except NotAFile as exc:
        why = f"{exc}, not a file"
    except TooLarge as exc:
        why = f"{exc} of text need more than this machine's memory (each character an 8-byte id)"
    except UnicodeDecodeError as exc:
        why = f"not UTF-8 text ({exc.reason} at byte {exc.start})"
    except OSError as exc:
        why = exc.strerror or str(exc)
    raise UserError(f"`data_dir` {path}: {why}")


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a counter to a uniform 64-bit draw (bias mod a text under 2**-24)."""
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@dataclass(frozen=True)
class TextWindows:
    """The training text as ids, and how a step's samples become windows of it."""

    stream: np.ndarray  # the training text's ids
    block: int
    per_epoch: int  # samples an epoch counts

    def starts(self, seed: int, step: int, samples: np.ndarray) -> np.ndarray:
        """The window starts of ``samples`` at ``step``, each a hash of (seed, step, sample)."""
        key = np.zeros(1, dtype=np.uint64)
        for word in (seed, 0x7E47, step):  # 0x7E47: apart from every other draw of the seed
            key = _mix(key ^ np.uint64(int(word) % 2**64))
        drawn = _mix(key ^ np.asarray(samples, dtype=np.int64).astype(np.uint64))
        limit = len(self.stream) - self.block  # each window and its labels fit in the text
        return (drawn % np.uint64(limit)).astype(np.int64)

    def spans(self, seed: int, step: int, samples: np.ndarray) -> np.ndarray:
        """(len(samples), block) positions of the windows in ``stream`` (labels: one later)."""
        return self.starts(seed, step, samples)[:, None] + np.arange(self.block)


def load_text(
    name: str, data_dir: str | os.PathLike | None, block: int, download: bool
) -> tuple[TextWindows, np.ndarray, np.ndarray, Vocabulary]:
    """(training windows, validation inputs and labels, vocabulary) of a text set."""
    if name != "tinyshakespeare" and data_dir is None:
        raise UserError("`dataset` text: needs `data_dir`, the UTF-8 file to train on")
    path = shakespeare_path(data_dir, download) if name == "tinyshakespeare" else Path(data_dir)
    text = read_text(path)
    vocab = Vocabulary("".join(sorted(set(text))))
    ids = vocab.encode(text)
    cut = int(len(ids) * 0.9)  # the rest validates in consecutive windows
    train, held = ids[:cut], ids[cut:]
    if len(train) <= block or len(held) <= block:
        raise UserError(
            f"`data_dir`: {len(ids):,} characters are too few for windows of `block` {block} "
            f"(90 % trains, 10 % validates: each part needs more than {block})"
        )
    n_val = (len(held) - 1) // block
    val = held[: n_val * block + 1]
    x_test, y_test = val[:-1].reshape(n_val, block), val[1:].reshape(n_val, block)
    return TextWindows(train, block, TEXT_WINDOWS), x_test, y_test, vocab


def text_metrics(dataset: Any, loss: float, accuracy: float, samples_per_s: float) -> dict:
    """A text set's evaluation in its own words (``val_loss`` in nats per character)."""
    if dataset.vocab is None:
        return {}
    return {
        "val_loss": loss,
        "perplexity": math.exp(min(loss, 700.0)),  # a diverged run's loss overflows exp
        "next_char_acc": accuracy,
        "tokens_per_s": samples_per_s * dataset.x_train.shape[1],
    }
