"""A step's rows split over the data-parallel ranks: contiguous blocks, balanced by response tokens.

Every DP rank trains on one block of the step's rows (DESIGN.md §7). The split is a pure function of the
rows' response lengths and the DP size, so every rank computes the same blocks from the same step record and
no rank is told its rows. Blocks are contiguous (row order is kept: a GRPO group of samples_per_prompt
copies stays together unless a block boundary must cut it, which does not matter for the loss: A_ORM is
computed over the whole step before the split) and every block holds at least one row (a DP rank with no
rows would have nothing to backpropagate, and DDP's all-reduce needs every rank).

Balance: boundary k (1 ≤ k < parts) is the row index whose prefix sum of tokens is nearest to k·total/parts
(ties: the lower index), kept inside the range that leaves every block at least one row. Each block's
tokens then differ from total/parts by at most the largest row's tokens. Rows with 0 response tokens
weigh 0; when every row weighs 0 the rows themselves are counted.

The loss does not depend on the split: the engine divides each rank's loss sum by the token count of the
whole step (engines/data_parallel.py), so DP = n computes the DP = 1 update whatever the blocks are.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass


class ShardError(ValueError):
    """A split that cannot be made: fewer rows than DP ranks, a negative length, parts < 1."""


@dataclass(frozen=True, slots=True)
class Shard:
    """Rows [start, stop) of the step for DP rank `rank`; `tokens` is their response-token count."""

    rank: int
    start: int
    stop: int
    tokens: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


def shard_rows(response_lengths: Sequence[int], parts: int) -> tuple[Shard, ...]:
    """The `parts` contiguous blocks of the rows (module docstring), in rank order.

    Args:
        response_lengths: response tokens of each row of the step, ≥ 0, in row order.
        parts: the data-parallel size, ≥ 1.

    Raises:
        ShardError: parts < 1, a negative length, or fewer rows than parts (the way out: more prompts per
            step, data.batch_size · data.samples_per_prompt ≥ the DP size).
    """
    n = len(response_lengths)
    if parts < 1:
        raise ShardError(f"parts={parts}: expected a data-parallel size >= 1")
    if any(x < 0 for x in response_lengths):
        raise ShardError(f"response_lengths holds a negative length {min(response_lengths)}")
    if n < parts:
        raise ShardError(
            f"{n} rows for {parts} data-parallel ranks: every rank needs at least one row; expected "
            f"data.batch_size · data.samples_per_prompt >= {parts}"
        )
    weights = list(response_lengths) if sum(response_lengths) > 0 else [1] * n
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    total = prefix[-1]
    bounds = [0]
    for k in range(1, parts):
        low, high = bounds[-1] + 1, n - (parts - k)  # leave one row per remaining block
        target = k * total / parts
        i = bisect.bisect_left(prefix, target, lo=low, hi=high + 1)
        candidates = [j for j in (i - 1, i) if low <= j <= high]
        bounds.append(min(candidates, key=lambda j: (abs(prefix[j] - target), j)))
    bounds.append(n)
    return tuple(
        Shard(rank, bounds[rank], bounds[rank + 1], sum(response_lengths[bounds[rank] : bounds[rank + 1]]))
        for rank in range(parts)
    )
