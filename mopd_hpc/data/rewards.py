"""Rewards: a completion of a `Prompt` → a float in [0, 1]; accuracy counts rewards of exactly 1.

- `reasoning_gym` prompts: the dataset's own `score_answer(answer, entry)` (reasoning-gym 0.1.25,
  `ProceduralDataset.score_answer` and its per-task overrides; e.g. chain_sum and leg_counting use
  `utils.compute_decimal_reward`: `"+014"` scores 1.0 against `"14"`, an answer that merely
  contains the oracle scores len(oracle)/len(answer)). The scorer is the dataset built with the
  prompt's own task arguments, so a task whose scoring reads its config is scored correctly.
- `jsonl` prompts: exact match of the stripped completion against the stripped reference answer
  (1.0 or 0.0; case- and space-sensitive inside the text).

The answer is taken from the completion by `extract_answer`: the last `<answer>…</answer>` span when
the completion has one (reasoning-gym's convention for its full questions), otherwise the whole
completion with surrounding whitespace stripped (the tiny models' short format: `14` then EOS).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from mopd_hpc.data.errors import DataSourceError
from mopd_hpc.data.prompt import Prompt

CORRECT_REWARD = 1.0
"""A completion is counted correct (for accuracy) when its reward equals this value exactly."""

_ANSWER_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", flags=re.DOTALL)


def extract_answer(completion: str) -> str:
    """The answer part of a decoded completion (special tokens already removed)."""
    tagged = _ANSWER_TAG.findall(completion)
    return (tagged[-1] if tagged else completion).strip()


def score_completion(prompt: Prompt, completion: str) -> float:
    """Reward of `completion` (decoded text, special tokens skipped) for `prompt`, in [0, 1].

    Raises:
        DataSourceError: the prompt's task is not a registered reasoning-gym task.
    """
    answer = extract_answer(completion)
    if prompt.kind == "jsonl":
        return CORRECT_REWARD if answer == prompt.answer.strip() else 0.0
    scorer = reasoning_gym_scorer(prompt.task, prompt.task_args_json)
    return float(scorer.score_answer(answer=answer, entry=prompt.entry))


def is_correct(reward: float) -> bool:
    """True when `reward` counts as a correct answer (exactly `CORRECT_REWARD`)."""
    return reward == CORRECT_REWARD


@functools.lru_cache(maxsize=64)
def reasoning_gym_scorer(task: str, task_args_json: str) -> Any:
    """The reasoning-gym dataset whose `score_answer` scores `task` (cached per task and arguments).

    Raises:
        DataSourceError: unknown task or arguments the task's config rejects.
    """
    return create_reasoning_gym_dataset(task, json.loads(task_args_json), seed=0, size=1)


def create_reasoning_gym_dataset(task: str, task_args: dict[str, Any], *, seed: int, size: int) -> Any:
    """`reasoning_gym.create_dataset(task, seed=seed, size=size, **task_args)`, errors made ours.

    Raises:
        DataSourceError: unknown task (the message lists the known ones), or arguments the task's
            config rejects (unknown name, failed validation).
    """
    import reasoning_gym  # deferred: importing reasoning-gym costs about a second
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        raise DataSourceError(
            f"reasoning-gym task: unknown task {task!r} (known: {', '.join(sorted(DATASETS))})"
        )
    reserved = {"seed", "size"} & set(task_args)
    if reserved:
        raise DataSourceError(
            f"task_args of {task!r}: {sorted(reserved)} are set by the source (seed, split, size), "
            f"not in task_args (got {task_args!r})"
        )
    try:
        return reasoning_gym.create_dataset(task, seed=seed, size=size, **task_args)
    except (TypeError, AssertionError, ValueError) as exc:
        raise DataSourceError(
            f"task_args of {task!r}: rejected by reasoning-gym: {exc} (got {task_args!r})"
        ) from exc
