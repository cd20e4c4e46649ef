"""Shuffling and sharding: every rank agrees on the order, and the shards tile each batch."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xpnn.data import epoch_order, global_batches, shard
from xpnn.errors import UserError


def test_epoch_order_is_a_seeded_permutation() -> None:
    order = epoch_order(1000, seed=3, epoch=0)
    assert sorted(order) == list(range(1000))
    np.testing.assert_array_equal(order, epoch_order(1000, seed=3, epoch=0))
    np.testing.assert_array_equal(order, np.random.default_rng([3, 0]).permutation(1000))
    assert not np.array_equal(order, epoch_order(1000, seed=3, epoch=1))
    assert not np.array_equal(order, epoch_order(1000, seed=4, epoch=0))


def test_negative_seed_is_user_error() -> None:
    with pytest.raises(UserError, match="^`seed`: "):
        epoch_order(10, seed=-1, epoch=0)


@pytest.mark.parametrize("n, batch_size, sizes", [(10, 4, [4, 4, 2]), (8, 4, [4, 4]), (3, 8, [3])])
def test_global_batches_cover_the_epoch(n: int, batch_size: int, sizes: list[int]) -> None:
    batches = global_batches(n, batch_size, seed=0, epoch=2)
    assert [len(b) for b in batches] == sizes
    np.testing.assert_array_equal(np.concatenate(batches), epoch_order(n, 0, 2))


def test_drop_last() -> None:
    assert [len(b) for b in global_batches(10, 4, 0, 0, drop_last=True)] == [4, 4]
    assert [len(b) for b in global_batches(8, 4, 0, 0, drop_last=True)] == [4, 4]
    assert global_batches(3, 8, 0, 0, drop_last=True) == []
    assert global_batches(0, 8, 0, 0) == []


@pytest.mark.parametrize("batch_size", [0, -4])
def test_bad_batch_size(batch_size: int) -> None:
    with pytest.raises(UserError, match="^`batch_size`: "):
        global_batches(10, batch_size, 0, 0)


def test_shard_uneven_split() -> None:
    batch = np.arange(10)
    parts = [shard(batch, r, 4) for r in range(4)]
    assert [p.tolist() for p in parts] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]


def test_rank_may_get_nothing() -> None:
    batch = np.array([5, 6])
    assert [shard(batch, r, 3).tolist() for r in range(3)] == [[5], [6], []]


@pytest.mark.parametrize("rank, size", [(2, 2), (-1, 2), (0, 0)])
def test_bad_rank(rank: int, size: int) -> None:
    with pytest.raises(ValueError):
        shard(np.arange(4), rank, size)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 300), st.integers(1, 17))
def test_shards_match_array_split_and_tile_the_batch(length: int, size: int) -> None:
    batch = np.random.default_rng(length).permutation(1000)[:length]
    parts = [shard(batch, r, size) for r in range(size)]
    for mine, reference in zip(parts, np.array_split(batch, size), strict=True):
        np.testing.assert_array_equal(mine, reference)
    np.testing.assert_array_equal(np.concatenate(parts), batch)
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 500), st.integers(1, 64), st.integers(1, 8), st.integers(0, 5))
def test_every_sample_seen_once_per_epoch_whatever_the_ranks(
    n: int, batch_size: int, size: int, epoch: int
) -> None:
    """What each rank trains on, pooled over ranks, is exactly one pass over the data."""
    seen = [
        shard(batch, rank, size)
        for batch in global_batches(n, batch_size, seed=11, epoch=epoch)
        for rank in range(size)
    ]
    assert sorted(np.concatenate(seen).tolist()) == list(range(n))
