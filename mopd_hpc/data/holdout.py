"""Held-out splits of a source that has none of its own (a user's jsonl file): a fraction of its rows, kept out of
training, or the rows of a second file.

    train, held = split_rows(source, fraction=0.1, seed=10_000_000)   # ⌈0.1·rows⌉ rows held out
    held = held_out_file(source, "test.jsonl")                        # every row of a second file

The held-out rows of a fraction are `random.Random(f"{seed}/{name}").sample(range(rows), ⌈fraction·rows⌉)`:
the same rows for the same file, seed and source name on every process; the training rows are the others, in
file order. Every held-out prompt is renamed `<source>/eval` (EVAL_SUFFIX) and re-indexed 0.., as a
reasoning-gym source's held-out split is; it is scored by its source's own `score` (`scorer_name`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
from collections.abc import Sequence

from mopd_hpc.data.errors import DataSourceError, SourceIndexError
from mopd_hpc.data.prompt import Prompt
from mopd_hpc.data.scoring import Scoring
from mopd_hpc.data.sources import JsonlSource, PromptSource

#: The suffix of a held-out split's source name (reasoning-gym's `held_out()` names it so too).
EVAL_SUFFIX = "/eval"


def scorer_name(source: str) -> str:
    """The source whose `score` scores a prompt of `source`: `"gsm8k/eval"` → `"gsm8k"` (a source name holds no
    "/": config.types.Identifier)."""
    return source.removesuffix(EVAL_SUFFIX)


class RowSubset:
    """The rows `rows` of `source` (file order), re-indexed 0..len-1; scored by `source.score`.

    A `PromptSource` (data/sources.py): `name`, `__len__`, `__getitem__`, `score`.
    """

    __slots__ = ("name", "_source", "_rows")

    def __init__(self, source: PromptSource, rows: Sequence[int], name: str | None = None) -> None:
        self.name = name or source.name
        self._source, self._rows = source, tuple(rows)

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> Prompt:
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(self._rows):
            raise SourceIndexError(
                f"source {self.name!r}: index {index!r} out of range [0, {len(self._rows)})"
            )
        return dataclasses.replace(self._source[self._rows[index]], source=self.name, index=index)

    def score(self, prompt: Prompt, completion: str) -> float:
        """The reward of the source the rows come from."""
        return self._source.score(prompt, completion)

    def __repr__(self) -> str:
        return f"RowSubset(name={self.name!r}, source={self._source!r}, rows={len(self._rows)})"


def split_rows(source: PromptSource, fraction: float, seed: int) -> tuple[RowSubset, RowSubset]:
    """(training rows, held-out rows) of `source`: ⌈fraction·rows⌉ rows held out (module docstring).

    Args:
        source: the whole file (rows 0..n-1). fraction: in (0, 1). seed: data.eval.seed.

    Raises:
        DataSourceError: `fraction` outside (0, 1), or the split leaves no training row (naming the source,
            its row count and the fraction).
    """
    n = len(source)
    if not 0 < fraction < 1:
        raise DataSourceError(
            f"source {source.name!r}: eval_fraction {fraction!r}: expected a number in (0, 1)"
        )
    held = math.ceil(fraction * n)
    if held >= n:
        raise DataSourceError(
            f"source {source.name!r}: eval_fraction {fraction} of its {n} rows holds out {held}, leaving no "
            "training row: a smaller eval_fraction, more rows, or the held-out rows in eval_path"
        )
    chosen = set(random.Random(f"{seed}/{source.name}").sample(range(n), held))
    train = [i for i in range(n) if i not in chosen]
    return RowSubset(source, train), RowSubset(source, sorted(chosen), source.name + EVAL_SUFFIX)


def held_out_file(
    source: PromptSource, path: str | os.PathLike[str], scoring: Scoring | None = None
) -> RowSubset:
    """Every row of the jsonl file `path`, as the held-out split of `source` (scored by `source.score`), its
    prompts carrying `scoring`'s reward and template as the source's own rows do (None: exact match, raw).

    Raises:
        DataSourceError / JsonlFormatError: the file cannot be read, is empty or has a malformed line.
    """
    rows = JsonlSource.from_path(source.name, path, scoring)
    return RowSubset(_Scored(rows, source), range(len(rows)), source.name + EVAL_SUFFIX)


class _Scored:
    """`rows`' prompts with `scorer`'s reward."""

    __slots__ = ("name", "_rows", "_scorer")

    def __init__(self, rows: PromptSource, scorer: PromptSource) -> None:
        self.name, self._rows, self._scorer = rows.name, rows, scorer

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> Prompt:
        return self._rows[index]

    def score(self, prompt: Prompt, completion: str) -> float:
        return self._scorer.score(prompt, completion)
