"""Per-epoch shuffles drawn from (seed, epoch) alike on every rank, and per-rank shards."""

import numpy as np

from xpnn.errors import UserError


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
