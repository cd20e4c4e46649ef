"""Datasets by name (MNIST, Fashion-MNIST, synthetic, text): float32 inputs, int64 labels; the
per-epoch shuffles drawn from (seed, epoch) alike on every rank, and per-rank shards."""

import contextlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from xpnn.data.download import default_cache_dir, fetch, mirrors_from, sha256_file
from xpnn.data.files import NotAFile
from xpnn.data.files import memory_bytes as _memory_bytes
from xpnn.data.idx import IdxError, read_idx, read_idx_pair
from xpnn.data.text import TEXT_DATASETS, load_text
from xpnn.errors import UserError, path_problems
from xpnn.record.digest import arrays_digest

NUM_CLASSES = 10
DATASETS = ("mnist", "fashion-mnist", "synthetic", *TEXT_DATASETS)
TITLES = {"mnist": "MNIST", "fashion-mnist": "Fashion-MNIST"}

FILES = {  # role -> file name, alike for MNIST and Fashion-MNIST
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}

SHA256 = {  # of the gzip files, in FILES' order
    name: dict(zip(FILES.values(), hashes, strict=True))
    for name, hashes in {
        "mnist": (
            "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
            "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
            "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
            "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaf4ff8a1e6c4f8ab2",
        ),
        "fashion-mnist": (
            "b0564c3eedabfbf835052cff8503ea422014ce006caf5b757f851416ee8300c7",
            "0ae29f65d86684f32d1b9c85147786c547b9c6aebcaf235f0400a0cce308b056",
            "cc1d090a38ace84dfa1aa66e3ada7c336ef481a96936906477e6dd344da56eaa",
            "8d3605d196f4be44669e46906da9733c8131fef761fdbfec72c424d5222f1a05",
        ),
    }.items()
}


def check_int(name: str, value: int, least: int) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < least:
        raise UserError(f"`{name}`: must be an integer >= {least}, got {value!r}")


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The permutation of ``range(n)`` for this epoch, identical on every rank."""
    check_int("seed", seed, 0)  # ``np.random.default_rng`` takes only non-negative integers
    return np.random.default_rng([seed, epoch]).permutation(n)


def global_batches(
    n: int, batch_size: int, seed: int, epoch: int, drop_last: bool = False
) -> list[np.ndarray]:
    """This epoch's global batches as index arrays; the last may be short unless dropped."""
    check_int("batch_size", batch_size, 1)
    order = epoch_order(n, seed, epoch)
    batches = [order[start : start + batch_size] for start in range(0, n, batch_size)]
    if drop_last and batches and len(batches[-1]) < batch_size:
        batches.pop()
    return batches


def shard_bounds(length: int, rank: int, size: int) -> tuple[int, int]:
    """[start, stop) of ``rank``'s contiguous share; the first ``length % size`` get one extra."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"shard: need 0 <= rank < size, got rank={rank}, size={size}")
    base, extra = divmod(length, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def shard(batch_idx: np.ndarray, rank: int, size: int) -> np.ndarray:
    """This rank's contiguous slice of a global batch (``np.array_split``'s); it may be empty."""
    return batch_idx[slice(*shard_bounds(len(batch_idx), rank, size))]


@dataclass(frozen=True)
class Source:
    mirrors: tuple[str, ...]  # $XPNN_<NAME>_MIRRORS overrides them (``mirrors_for``)
    system_dir: Path | None = None  # a distribution package's copy, used before the cache


SOURCES = {
    "mnist": Source(
        mirrors=(
            "https://ossci-datasets.s3.amazonaws.com/mnist/",
            "https://storage.googleapis.com/cvdf-datasets/mnist/",
        ),
    ),
    "fashion-mnist": Source(
        mirrors=("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",),
        system_dir=Path("/usr/share/datasets/fashion-mnist"),  # Debian's dataset-fashion-mnist
    ),
}


@dataclass(frozen=True)
class Dataset:
    """Float32 inputs in [0, 1], int64 labels; ``x_train`` repeated ``train_repeats`` times."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    train_repeats: int = 1
    vocab: Any = None  # a text set's ``Vocabulary``: its ids' characters
    windows: Any = None  # a text set's ``TextWindows``: samples drawn afresh every step

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    @property
    def n_train(self) -> int:
        stored = self.x_train.shape[0] if self.windows is None else self.windows.per_epoch
        return stored * self.train_repeats

    def stored_rows(self, samples: np.ndarray) -> np.ndarray:
        """The rows of ``x_train`` / ``y_train`` that hold these training samples."""
        return samples % (self.n_train // self.train_repeats) if self.train_repeats > 1 else samples


def load_dataset(
    name: str,
    data_dir: str | os.PathLike | None = None,
    *,
    replicate: int = 1,
    synthetic_size: int = 6000,
    synthetic_shape: tuple[int, ...] = (1, 28, 28),
    seed: int = 0,
    download: bool = True,
    block: int = 64,
) -> Dataset:
    """A dataset by name, its training set repeated ``replicate`` times (scaling studies)."""
    check_int("replicate", replicate, 1)
    if name in TEXT_DATASETS:
        windows, x_test, y_test, vocab = load_text(name, data_dir, block, download=download)
        stream, window = windows.stream, np.lib.stride_tricks.sliding_window_view
        arrays = (window(stream[:-1], block), window(stream[1:], block), x_test, y_test)
        classes = len(vocab.chars)  # row s of the views: the window at s, nothing copied
        dataset = Dataset(name, *arrays, classes, vocab=vocab, windows=windows)
    elif name == "synthetic":
        dataset = make_synthetic(synthetic_size, tuple(synthetic_shape), seed)
    elif name in SOURCES:
        files = find_files(name, data_dir, download)
        x_train, y_train = _load_split(files, "train")
        x_test, y_test = _load_split(files, "test")
        if x_test.shape[1:] != x_train.shape[1:]:
            raise IdxError(
                f"{files['test_images']}: images are {'x'.join(map(str, x_test.shape[2:]))} but "
                f"{files['train_images']} has {'x'.join(map(str, x_train.shape[2:]))}"
            )
        dataset = Dataset(name, x_train, y_train, x_test, y_test, NUM_CLASSES)
    else:
        raise UserError(f"`dataset`: unknown dataset {name!r} (choose {', '.join(DATASETS)})")
    return replicate_train(dataset, replicate)


def replicate_train(dataset: Dataset, k: int) -> Dataset:
    """The training set repeated ``k`` times, nothing copied; refused if its order cannot fit."""
    if k == 1:
        return dataset
    total = dataset.n_train * k
    try:
        np.empty(total, dtype=np.int64)  # an epoch's order: refused now, not in epoch 1
    except MemoryError:
        raise MemoryError(
            f"an epoch's order of {total:,} samples needs {total * 8 / 2**30:,.1f} GiB"
        ) from None
    return replace(dataset, train_repeats=dataset.train_repeats * k)


def mirrors_for(name: str) -> list[str]:
    return mirrors_from(f"XPNN_{name.upper().replace('-', '_')}_MIRRORS", SOURCES[name].mirrors)


def _not_there(directory: Path, gz_name: str, raw_name: str) -> str:
    for candidate in (directory / gz_name, directory / raw_name):
        if candidate.exists():
            return f"{candidate.name} (not a file)"
        if candidate.is_symlink():
            target = os.readlink(candidate)
            return f"{candidate.name} (a symbolic link to {target}, which does not exist)"
    return f"{gz_name} (or {raw_name})"


def _files_in_dir(name: str, directory: Path) -> dict[str, Path]:
    """The four files in a user's directory, each gzip or uncompressed; all must be there."""
    found, missing = {}, []
    with path_problems("data_dir", directory):
        if not directory.is_dir():
            what = "not a directory" if directory.exists() else "no such directory"
            expanded = Path(os.path.expanduser(directory))  # Path.expanduser raises for ~nosuchuser
            if expanded != directory and not directory.exists():  # --data-dir=~/d: no ~ after =
                what += f" (the shell left its ~ as it is: did you mean {expanded}?)"
            raise UserError(f"`data_dir` {directory}: {what}")
        for role, gz_name in FILES.items():
            raw_name = gz_name.removesuffix(".gz")
            there = [c for c in (directory / gz_name, directory / raw_name) if c.is_file()]
            if len(there) == 2 and not np.array_equal(read_idx(there[0]), read_idx(there[1])):
                raise UserError(  # ``gunzip -k``: the .gz is read, so both must agree
                    f"`data_dir` {directory}: {there[0].name} and {there[1].name} hold different "
                    "data; remove the one not meant"
                )
            if there:
                found[role] = there[0]
            else:
                missing.append(_not_there(directory, gz_name, raw_name))
    if missing:
        raise UserError(f"`data_dir` {directory}: missing {', '.join(missing)}")
    _check_known_files(name, found)
    return found


def _check_known_files(name: str, found: dict[str, Path]) -> None:
    """Refuse a file that is another dataset's or role's (test images named as training ones)."""
    for role, path in found.items():
        digest = None
        with contextlib.suppress(OSError, NotAFile):  # reading it will say what is wrong
            if path.stat().st_size <= 32 << 20:  # SHA256's largest has 26 MB: no larger is hashed
                digest = sha256_file(path)
        known = next(((d, f) for d, t in SHA256.items() for f, h in t.items() if h == digest), None)
        if known is None or known == (name, FILES[role]):
            continue
        dataset, filename = known
        hint = f"; use `dataset` {dataset}" if dataset != name else ""
        raise UserError(
            f"{path}: this is {TITLES[dataset]}'s {filename}, not {TITLES[name]}'s "
            f"{FILES[role]} (by its SHA-256){hint}"
        )


def find_files(name: str, data_dir: str | os.PathLike | None, download: bool) -> dict[str, Path]:
    """The four files: in --data-dir, else the system copy, else the (hash-checked) cache."""
    if data_dir is not None:
        return _files_in_dir(name, Path(data_dir))
    system_dir = SOURCES[name].system_dir
    if system_dir is not None and all((system_dir / fn).is_file() for fn in FILES.values()):
        return {role: system_dir / fn for role, fn in FILES.items()}
    cache, hashes, mirrors = default_cache_dir() / name, SHA256[name], mirrors_for(name)
    holding = f"DIR holding the {name} files"
    return {
        role: fetch(fn, hashes[fn], mirrors, cache, download=download, holding=holding)
        for role, fn in FILES.items()
    }


def _load_split(files: dict[str, Path], split: str) -> tuple[np.ndarray, np.ndarray]:
    """uint8 (N, H, W) pixels as float32 (N, 1, H, W) in [0, 1], and the labels."""
    images_path, labels_path = files[f"{split}_images"], files[f"{split}_labels"]
    images, labels = read_idx_pair(images_path, labels_path, NUM_CLASSES)
    if images.dtype != np.uint8:
        raise IdxError(
            f"{images_path}: pixels are {images.dtype.name}, expected unsigned bytes (0x08)"
        )
    x = images.astype(np.float32)
    x /= np.float32(255)
    return x.reshape(images.shape[0], 1, *images.shape[1:]), labels


def check_same_data(
    dataset: Dataset, data_dir: str | os.PathLike | None, allgather: Callable[[Any], list]
) -> None:
    """Refuse ranks that read other data: they would train on other samples or stop out of step."""
    if dataset.name == "synthetic":  # made from the flags, which every rank shares
        return
    sizes = (dataset.x_train.shape[0], dataset.x_test.shape[0])
    values = arrays_digest((dataset.x_train, dataset.y_train, dataset.x_test, dataset.y_test))
    everyone = allgather((str(data_dir) if data_dir else None, sizes, values))
    first_dir, first_sizes, first_digest = everyone[0]
    for rank, (where, sizes, digest) in enumerate(everyone):
        if digest == first_digest:
            continue
        what = "the same number of samples but other values"
        if sizes != first_sizes:
            what = "{} train / {} test samples, rank 0 {} / {}".format(*sizes, *first_sizes)
        here = f"`data_dir` {where}" if where else "the default files"
        there = f"`data_dir` {first_dir}" if first_dir else "the default files"
        raise UserError(
            f"`data_dir`: rank {rank} read other data than rank 0 ({what}; rank {rank} from "
            f"{here}, rank 0 from {there}); every rank must read the same files"
        )


def _synthetic_split(
    prototypes: np.ndarray, n: int, rng: np.random.Generator, noise: float = 0.35
) -> tuple[np.ndarray, np.ndarray]:
    """Class prototypes at random brightness plus noise in [0, 1], the images allocated first."""
    x = np.empty((n, *prototypes.shape[1:]), dtype=np.float32)
    y = rng.integers(0, NUM_CLASSES, size=n, dtype=np.int64)
    brightness = rng.uniform(0.6, 1.0, size=n).astype(np.float32)
    chunk = 8192  # bounds the temporary memory for large sizes
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        part = rng.standard_normal((stop - start, *x.shape[1:]), dtype=np.float32)
        part *= np.float32(noise)
        part += prototypes[y[start:stop]] * brightness[start:stop].reshape(-1, *[1] * (x.ndim - 1))
        np.clip(part, 0.0, 1.0, out=x[start:stop])
    return x, y


def make_synthetic(size: int, shape: tuple[int, ...] = (1, 28, 28), seed: int = 0) -> Dataset:
    """A deterministic, learnable 10-class set; its test set has max(1000, size // 6) samples."""
    check_int("synthetic_size", size, 1)
    if not shape or not all(isinstance(d, (int, np.integer)) and d >= 1 for d in shape):
        raise UserError(f"synthetic shape must be positive integers, got {shape!r}")
    check_int("seed", seed, 0)
    size, n_test = int(size), max(1000, int(size) // 6)
    # refused before anything is allocated: each array alone may fit, all together not
    per_sample = 4 * math.prod(int(d) for d in shape) + 8 + 8  # pixels, label, brightness
    need, have = (size + n_test) * per_sample, _memory_bytes()
    if have is not None and need > have:
        raise MemoryError(
            f"{size:,} samples of {'x'.join(map(str, shape))} and {n_test:,} test samples "
            f"need {need / 2**30:,.1f} GiB, more than this machine's {have / 2**30:,.1f} GiB "
            "of memory and swap"
        )
    prototypes = np.random.default_rng([seed, 0]).random((NUM_CLASSES, *shape), dtype=np.float32)
    x_train, y_train = _synthetic_split(prototypes, size, np.random.default_rng([seed, 1]))
    x_test, y_test = _synthetic_split(prototypes, n_test, np.random.default_rng([seed, 2]))
    return Dataset("synthetic", x_train, y_train, x_test, y_test, NUM_CLASSES)
