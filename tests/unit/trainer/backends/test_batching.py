"""Splitting a step's samples: micro-batches under a token cap, rank balancing, contiguous
shards. Properties are checked over many seeded random length lists."""

from __future__ import annotations

import random

import pytest

from millstream.trainer.backends.batching import (
    balance_across_ranks,
    contiguous_shards,
    pack_by_tokens,
)


def random_lengths(seed: int) -> list[int]:
    rng = random.Random(seed)
    n = rng.randint(0, 60)
    top = rng.choice([1, 10, 100, 1000])
    return [rng.randint(0, top) for _ in range(n)]


def assert_exact_cover(parts: list[list[int]], n: int) -> None:
    flat = [i for p in parts for i in p]
    assert sorted(flat) == list(range(n))
    assert all(p == sorted(p) for p in parts)


def tokens(part: list[int], lengths: list[int]) -> int:
    return sum(lengths[i] for i in part)


@pytest.mark.parametrize("seed", range(300))
def test_packing_covers_every_index_once_under_the_cap(seed):
    lengths = random_lengths(seed)
    max_tokens = random.Random(-seed).randint(1, 1200)
    bins = pack_by_tokens(lengths, max_tokens)
    assert_exact_cover(bins, len(lengths))
    assert all(b for b in bins)
    assert [b[0] for b in bins] == sorted(b[0] for b in bins)
    loads = [tokens(b, lengths) for b in bins]
    for b, load in zip(bins, loads, strict=True):
        assert load <= max_tokens or len(b) == 1
    # Few micro-batches: first-fit leaves no two that could be merged under the cap.
    fitting = [load for load in loads if load <= max_tokens]
    for a in range(len(fitting)):
        for b in range(a + 1, len(fitting)):
            assert fitting[a] + fitting[b] > max_tokens
    assert pack_by_tokens(lengths, max_tokens) == bins


def test_packing_examples():
    assert pack_by_tokens([5, 5, 5, 5], 10) == [[0, 1], [2, 3]]
    assert pack_by_tokens([3, 3, 3], 6) == [[0, 1], [2]]
    assert pack_by_tokens([2, 7, 3, 8], 10) == [[0, 3], [1, 2]]
    assert pack_by_tokens([0, 0, 4], 4) == [[0, 1, 2]]
    assert pack_by_tokens([], 10) == []


def test_oversized_sample_goes_alone_and_is_not_dropped():
    bins = pack_by_tokens([3, 50, 4, 12, 2], 10)
    assert [1] in bins and [3] in bins
    assert bins == [[0, 2, 4], [1], [3]]
    assert pack_by_tokens([0, 11], 10) == [[0], [1]]


@pytest.mark.parametrize("seed", range(300))
def test_balance_covers_every_index_once_with_a_small_spread(seed):
    lengths = random_lengths(seed)
    world_size = random.Random(-seed).randint(1, 8)
    if len(lengths) < world_size:
        with pytest.raises(ValueError, match="at least one"):
            balance_across_ranks(lengths, world_size)
        return
    parts = balance_across_ranks(lengths, world_size)
    assert len(parts) == world_size
    assert_exact_cover(parts, len(lengths))
    assert all(parts)
    sums = [tokens(p, lengths) for p in parts]
    assert max(sums) - min(sums) <= max(lengths)
    assert balance_across_ranks(lengths, world_size) == parts


def test_balance_on_a_descending_run_is_near_even():
    lengths = list(range(10, 0, -1))  # 55 tokens
    for world_size, spread in [(2, 1), (3, 1), (5, 0)]:
        sums = [tokens(p, lengths) for p in balance_across_ranks(lengths, world_size)]
        assert sum(sums) == 55
        assert max(sums) - min(sums) == spread


def test_balance_beats_contiguous_shards_on_a_skewed_batch():
    lengths = [100, 90, 80, 70, 1, 1, 1, 1]
    balanced = [tokens(p, lengths) for p in balance_across_ranks(lengths, 2)]
    contiguous = [tokens(p, lengths) for p in contiguous_shards(len(lengths), 2)]
    assert contiguous == [340, 4]
    assert sorted(balanced) == [172, 172]
    assert max(balanced) - min(balanced) < max(contiguous) - min(contiguous)


def test_balance_leaves_no_rank_empty_even_with_zero_lengths():
    parts = balance_across_ranks([0, 0, 0, 0], 4)
    assert parts == [[0], [1], [2], [3]]
    assert all(balance_across_ranks([5, 0, 0], 3))


def test_one_rank_gets_everything():
    lengths = [4, 1, 9]
    assert balance_across_ranks(lengths, 1) == [[0, 1, 2]]
    assert contiguous_shards(3, 1) == [[0, 1, 2]]


def shard_bounds(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """[lo, hi) of rank's share, written independently of batching.py."""
    base, extra = divmod(n, world_size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


@pytest.mark.parametrize("n", range(0, 23))
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7, 8])
def test_contiguous_shards_match_the_bounds_formula(n, world_size):
    shards = contiguous_shards(n, world_size)
    assert len(shards) == world_size
    assert [i for s in shards for i in s] == list(range(n))
    assert [(s[0], s[-1] + 1) for s in shards if s] == [
        shard_bounds(n, r, world_size) for r in range(world_size) if shards[r]
    ]
    sizes = [len(s) for s in shards]
    assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1


def test_contiguous_shards_example():
    assert contiguous_shards(7, 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert contiguous_shards(2, 3) == [[0], [1], []]


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="max_tokens = 0"):
        pack_by_tokens([1], 0)
    with pytest.raises(ValueError, match="max_tokens = -3"):
        pack_by_tokens([1], -3)
    with pytest.raises(ValueError, match=r"lengths\[1\] = -2"):
        pack_by_tokens([1, -2], 10)
    with pytest.raises(ValueError, match=r"lengths\[0\] = -1"):
        balance_across_ranks([-1, 2], 2)
    with pytest.raises(ValueError, match="2 samples cannot be balanced over 3 ranks"):
        balance_across_ranks([1, 2], 3)
    with pytest.raises(ValueError, match="world_size = 0"):
        balance_across_ranks([1, 2], 0)
    with pytest.raises(ValueError, match="world_size = 0"):
        contiguous_shards(4, 0)
    with pytest.raises(ValueError, match="n = -1"):
        contiguous_shards(-1, 2)
