"""The split of a step's rows over the data-parallel ranks (trainer/shards.py): contiguous, every row once,
every rank at least one row, balanced by response tokens within the largest row, the same on every call."""

from __future__ import annotations

import random

import pytest

from mopd_hpc.trainer.shards import ShardError, shard_rows


def test_equal_rows_split_evenly_and_in_order():
    shards = shard_rows([4] * 8, 2)
    assert [(s.rank, s.start, s.stop, s.tokens) for s in shards] == [(0, 0, 4, 16), (1, 4, 8, 16)]
    assert [s.rows for s in shards] == [4, 4]
    assert shard_rows([4] * 8, 1)[0] == shards[0].__class__(0, 0, 8, 32)


def test_balanced_by_tokens_not_by_rows():
    # one long row weighs as much as the six short ones after it
    shards = shard_rows([12, 2, 2, 2, 2, 2, 2], 2)
    assert [(s.start, s.stop, s.tokens) for s in shards] == [(0, 1, 12), (1, 7, 12)]
    # the nearest prefix sum wins: 3+3 = 6 of 10 is nearer to 5 than 3 is
    assert [(s.start, s.stop) for s in shard_rows([3, 3, 2, 2], 2)] == [(0, 2), (2, 4)]


@pytest.mark.parametrize("seed", range(20))
def test_partition_properties_on_random_steps(seed):
    rng = random.Random(seed)
    rows = rng.randint(1, 60)
    parts = rng.randint(1, rows)
    lengths = [rng.choice([0, 1, 5, 40, rng.randint(0, 200)]) for _ in range(rows)]
    shards = shard_rows(lengths, parts)
    assert shards == shard_rows(list(lengths), parts)  # a pure function: every rank computes the same
    assert [s.rank for s in shards] == list(range(parts))
    assert shards[0].start == 0 and shards[-1].stop == rows
    assert all(
        a.stop == b.start for a, b in zip(shards, shards[1:], strict=False)
    )  # contiguous, every row exactly once
    assert all(s.rows >= 1 for s in shards)
    assert sum(s.tokens for s in shards) == sum(lengths)
    if sum(lengths) and rows >= 2 * parts:  # room to balance: each block within the largest row of the mean
        mean = sum(lengths) / parts
        assert all(abs(s.tokens - mean) <= 2 * max(lengths) for s in shards), (lengths, shards)


def test_all_empty_rows_are_split_by_count():
    assert [(s.start, s.stop) for s in shard_rows([0] * 6, 3)] == [(0, 2), (2, 4), (4, 6)]


def test_fewer_rows_than_ranks_names_the_fields():
    with pytest.raises(
        ShardError, match=r"3 rows for 4 data-parallel ranks.*data.batch_size · data.samples_per_prompt >= 4"
    ):
        shard_rows([1, 2, 3], 4)
    with pytest.raises(ShardError, match="parts=0"):
        shard_rows([1], 0)
    with pytest.raises(ShardError, match="negative"):
        shard_rows([1, -1], 1)
