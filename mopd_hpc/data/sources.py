"""Dataset sources: indexable sequences of `Prompt`s (reasoning-gym tasks, users' jsonl files).

Every source has a `name`, `__len__`, `__getitem__(index) -> Prompt` (0 <= index < len, else
`SourceIndexError`, an IndexError) and `score(prompt, completion) -> float`, so a routed mixture
can draw from any of them by index and any process can score a completion.

Held-out split rule (reference/tiny_calibration.md, "Held-out set"): reasoning-gym builds item i of
a dataset with seed s from `random.Random(s + i)`, so seeds 1 and 2 share almost all their items.
A source with seed s therefore uses the RNG seeds

    train:  s + [0, size)                       size <= SPLIT_SPAN
    eval:   s + EVAL_SEED_OFFSET + [0, size)    size <= SPLIT_SPAN

which never overlap for one s (and for any two seeds below EVAL_SEED_OFFSET - SPLIT_SPAN).
Caveat: disjoint RNG seeds are not disjoint prompts when the problem space is small (easy
chain_sum has 4,200 distinct prompts; every held-out prompt also occurs in training), so
held-out accuracy there measures fitting, not generalization.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Protocol, get_args, runtime_checkable

from mopd_hpc.data.errors import DataSourceError, JsonlFormatError, SourceIndexError
from mopd_hpc.data.formatting import format_prompt
from mopd_hpc.data.prompt import SOURCE_KINDS, Prompt
from mopd_hpc.data.rewards import create_reasoning_gym_dataset, score_completion
from mopd_hpc.data.scoring import Scoring

Split = Literal["train", "eval"]
SPLITS: tuple[str, ...] = get_args(Split)

EVAL_SEED_OFFSET = 10**12
"""Added to a source's seed for its held-out (eval) split; far above any training index."""
SPLIT_SPAN = 10**11
"""The largest size of one split, so train seeds s+[0, SPLIT_SPAN) never reach the eval seeds."""
DEFAULT_SIZE: dict[str, int] = {"train": 10**9, "eval": 1000}
"""Split sizes when none is given: a virtually endless training stream, 1000 held-out prompts."""


@runtime_checkable
class PromptSource(Protocol):
    """What a routed mixture needs from a source."""

    name: str

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Prompt: ...

    def score(self, prompt: Prompt, completion: str) -> float: ...


class ReasoningGymSource:
    """Prompts of one reasoning-gym task, formatted by `mopd_hpc.data.formatting.format_prompt`.

    Build with `ReasoningGymSource.create(...)`. Item i is a pure function of (task, task_args,
    seed, split, i): two processes building the same source see the same prompts.
    """

    __slots__ = ("name", "task", "task_args", "seed", "split", "size", "_dataset", "scoring")

    def __init__(
        self,
        name: str,
        task: str,
        task_args: dict[str, Any],
        seed: int,
        split: str,
        size: int,
        dataset: Any,
        scoring: Scoring,
    ) -> None:
        self.name, self.task, self.task_args = name, task, task_args
        self.seed, self.split, self.size = seed, split, size
        self._dataset = dataset
        self.scoring = scoring

    @classmethod
    def create(
        cls,
        name: str,
        task: str,
        task_args: Mapping[str, Any] | None = None,
        *,
        seed: int = 0,
        split: str = "train",
        size: int | None = None,
        scoring: Scoring | None = None,
    ) -> ReasoningGymSource:
        """Validate the arguments and build the source.

        Args:
            name: the source's name (run.yaml `data.sources[].name`).
            task: a registered reasoning-gym task, e.g. `chain_sum`.
            task_args: the task config's keyword arguments except seed and size,
                e.g. `{"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}`.
            seed: the base seed, 0 <= seed < EVAL_SEED_OFFSET - SPLIT_SPAN.
            split: `train` or `eval` (see the module docstring for the RNG seeds each uses).
            size: number of prompts, 1..SPLIT_SPAN; default `DEFAULT_SIZE[split]`.
            scoring: the reward and the prompt template of every prompt (default: the dataset's own
                `score_answer`, raw text).
        Raises:
            DataSourceError: an unknown task or split, arguments the task rejects, or a seed or size
                out of range.
        """
        if not name:
            raise DataSourceError(f"source name: must not be empty (task {task!r})")
        if split not in SPLITS:
            raise DataSourceError(f"source {name!r}: split: unknown split {split!r} (known: {SPLITS})")
        seed_max = EVAL_SEED_OFFSET - SPLIT_SPAN
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < seed_max:
            raise DataSourceError(f"source {name!r}: seed: expected an int in [0, {seed_max}) (got {seed!r})")
        size = DEFAULT_SIZE[split] if size is None else size
        if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= SPLIT_SPAN:
            raise DataSourceError(
                f"source {name!r}: size: expected an int in [1, {SPLIT_SPAN}] (got {size!r})"
            )
        args = dict(task_args or {})
        rg_seed = seed + (EVAL_SEED_OFFSET if split == "eval" else 0)
        dataset = create_reasoning_gym_dataset(task, args, seed=rg_seed, size=size)
        return cls(name, task, args, seed, split, size, dataset, scoring or Scoring())

    @property
    def rng_seeds(self) -> range:
        """The `random.Random` seeds of this source's items, in index order."""
        start = self.seed + (EVAL_SEED_OFFSET if self.split == "eval" else 0)
        return range(start, start + self.size)

    def held_out(self, size: int | None = None, name: str | None = None) -> ReasoningGymSource:
        """The eval split of this task, arguments and seed (default name `<name>/eval`).

        Raises:
            DataSourceError: this source is already an eval split, or `size` is out of range.
        """
        if self.split == "eval":
            raise DataSourceError(
                f"source {self.name!r}: held_out() of an eval split (call it on the train split)"
            )
        return ReasoningGymSource.create(
            name or f"{self.name}/eval",
            self.task,
            self.task_args,
            seed=self.seed,
            split="eval",
            size=size,
            scoring=self.scoring,
        )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Prompt:
        _check_index(self.name, index, self.size)
        entry = self._dataset[index]
        return Prompt.create(
            kind="reasoning_gym",
            source=self.name,
            index=index,
            text=format_prompt(self.task, entry),
            answer=str(entry["answer"]),
            task=self.task,
            task_args=self.task_args,
            entry=entry,
            **self.scoring.prompt_fields(),
        )

    def score(self, prompt: Prompt, completion: str) -> float:
        """The prompt's reward (`mopd_hpc.data.rewards.score_completion`; default the dataset's own
        `score_answer`)."""
        return score_completion(prompt, completion)

    def __repr__(self) -> str:
        return (
            f"ReasoningGymSource(name={self.name!r}, task={self.task!r}, task_args={self.task_args!r}, "
            f"seed={self.seed}, split={self.split!r}, size={self.size})"
        )


class JsonlSource:
    """Users' own prompts: one JSON object per line, `{"prompt": "<text>", "answer": "<text>"}`.

    Blank lines are skipped (line numbers in errors still count them); other keys are kept in the
    prompt's entry. The reward is the source's `scoring` (default: the exact match of the stripped answer;
    `mopd_hpc.data.rewards`).
    A jsonl source has no held-out split of its own: give the evaluation prompts as a second file.
    """

    __slots__ = ("name", "path", "_prompts")

    def __init__(self, name: str, path: str, prompts: tuple[Prompt, ...]) -> None:
        self.name, self.path, self._prompts = name, path, prompts

    @classmethod
    def from_path(
        cls, name: str, path: str | os.PathLike[str], scoring: Scoring | None = None
    ) -> JsonlSource:
        """Read and validate the whole file; `scoring`: reward and template (default exact match, raw).

        Raises:
            DataSourceError: the file cannot be read or holds no prompt.
            JsonlFormatError: a line is not UTF-8 text (binary bytes), not valid JSON, not an object, or
                lacks a non-empty string `prompt` or a string `answer` (the message names file:line).
        """
        text_path = os.fspath(path)
        try:
            lines = Path(text_path).read_bytes().splitlines()
        except OSError as exc:
            raise DataSourceError(f"source {name!r}: cannot read jsonl file {text_path!r}: {exc}") from exc
        prompts = []
        for line_no, raw in enumerate(lines, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise JsonlFormatError(
                    text_path, line_no, f"binary bytes, not UTF-8 text ({exc.reason} at byte {exc.start})"
                ) from None
            if line.strip():
                obj = _parse_line(text_path, line_no, line)
                prompts.append(
                    Prompt.create(
                        kind="jsonl",
                        source=name,
                        index=len(prompts),
                        text=obj["prompt"],
                        answer=obj["answer"],
                        entry=obj,
                        **(scoring or Scoring()).prompt_fields(),
                    )
                )
        if not prompts:
            raise DataSourceError(f"source {name!r}: jsonl file {text_path!r} holds no prompt (it is empty)")
        return cls(name, text_path, tuple(prompts))

    def __len__(self) -> int:
        return len(self._prompts)

    def __getitem__(self, index: int) -> Prompt:
        _check_index(self.name, index, len(self._prompts))
        return self._prompts[index]

    def score(self, prompt: Prompt, completion: str) -> float:
        """The prompt's reward (`mopd_hpc.data.rewards.score_completion`; default exact match)."""
        return score_completion(prompt, completion)

    def __repr__(self) -> str:
        return f"JsonlSource(name={self.name!r}, path={self.path!r}, len={len(self._prompts)})"


def make_source(
    kind: str,
    name: str,
    *,
    task: str | None = None,
    task_args: Mapping[str, Any] | None = None,
    path: str | os.PathLike[str] | None = None,
    seed: int = 0,
    split: str = "train",
    size: int | None = None,
    scoring: Scoring | None = None,
) -> ReasoningGymSource | JsonlSource:
    """Build a source from the fields of a run.yaml `data.sources[]` entry.

    `reasoning_gym` needs `task` (and takes task_args, seed, split, size); `jsonl` needs `path`
    (a jsonl source ignores seed and size, and has only a train split); `scoring` is the entry's reward
    and prompt template fields.

    Raises:
        DataSourceError: unknown kind, a missing or misplaced field, or an error of the source.
    """
    if kind == "reasoning_gym":
        if not task or path is not None:
            raise DataSourceError(
                f"source {name!r}: kind reasoning_gym needs `task` and no `path` (got task={task!r}, path={path!r})"
            )
        return ReasoningGymSource.create(
            name, task, task_args, seed=seed, split=split, size=size, scoring=scoring
        )
    if kind == "jsonl":
        if path is None or task is not None or task_args:
            raise DataSourceError(
                f"source {name!r}: kind jsonl needs `path` and no `task`/`task_args` (got path={path!r}, task={task!r})"
            )
        if split != "train":
            raise DataSourceError(
                f"source {name!r}: a jsonl source has no {split!r} split; give the eval prompts as another file"
            )
        return JsonlSource.from_path(name, path, scoring)
    raise DataSourceError(f"source {name!r}: kind: unknown kind {kind!r} (known: {SOURCE_KINDS})")


def _check_index(name: str, index: int, size: int) -> None:
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < size:
        raise SourceIndexError(
            f"source {name!r}: index {index!r} out of range (expected an int in [0, {size}))"
        )


def _parse_line(path: str, line_no: int, line: str) -> dict[str, Any]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise JsonlFormatError(path, line_no, f"not valid JSON ({exc.msg} at column {exc.colno})") from exc
    except RecursionError:
        raise JsonlFormatError(
            path, line_no, "not valid JSON (nested deeper than the decoder allows)"
        ) from None
    if not isinstance(obj, dict):
        raise JsonlFormatError(
            path, line_no, f"expected a JSON object (got {type(obj).__name__}: {line.strip()[:80]!r})"
        )
    prompt, answer = obj.get("prompt"), obj.get("answer")
    raw = tuple(obj) if not {"prompt", "answer"} <= obj.keys() else None  # a field is missing: a raw row?
    if not isinstance(prompt, str) or not prompt:
        raise JsonlFormatError(path, line_no, f"'prompt' must be a non-empty string (got {prompt!r})", raw)
    if not isinstance(answer, str):
        raise JsonlFormatError(path, line_no, f"'answer' must be a string (got {answer!r})", raw)
    return obj
