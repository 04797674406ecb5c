"""Rewards: a completion of a `Prompt` → a float in [0, 1]; accuracy counts rewards of exactly 1.

The prompt's `reward` (its source's `reward` field; default by kind) picks the scorer:

- `reasoning_gym` (reasoning-gym sources' default): the dataset's own `score_answer(answer, entry)`
  (reasoning-gym 0.1.25, `ProceduralDataset.score_answer` and its per-task overrides; e.g. chain_sum and
  leg_counting use `utils.compute_decimal_reward`: `"+014"` scores 1.0 against `"14"`, an answer that
  merely contains the oracle scores len(oracle)/len(answer)). The scorer is the dataset built with the
  prompt's own task arguments, so a task whose scoring reads its config is scored correctly. It is given
  `extract_answer(completion)`.
- `exact` (jsonl sources' default), `regex`, `math`: `mopd_hpc.data.verifiers`.
- `module:function`: the user's function, `function(completion, answer, entry) -> float`
  (`mopd_hpc.data.verifiers.UserReward`).

Every reward is checked (`check_reward`): a finite number in [0, 1], else `RewardError` naming the
source, the row and the reward; an exception raised by a scorer is reported the same way.
"""

from __future__ import annotations

import functools
import json
import math
import numbers
from typing import Any

from mopd_hpc.data.errors import DataSourceError, RewardError
from mopd_hpc.data.prompt import Prompt
from mopd_hpc.data.verifiers import exact_reward, extract_answer, load_user_reward, math_reward, regex_reward

CORRECT_REWARD = 1.0
"""A completion is counted correct (for accuracy) when its reward equals this value exactly."""


def score_completion(prompt: Prompt, completion: str) -> float:
    """Reward of `completion` (decoded text, special tokens skipped) for `prompt`, in [0, 1].

    Raises:
        RewardError: the scorer raised, or returned something other than a finite number in [0, 1]
            (the message names the source, the row and the reward).
            That includes an unknown reasoning-gym task, a user's reward path that does not import, and a
            reference answer the math verifier cannot parse.
    """
    try:
        value = _score(prompt, completion)
    except RewardError:
        raise
    except Exception as exc:  # a scorer's own failure (a user's function included), named by its row
        raise RewardError(
            f"source {prompt.source!r}, row {prompt.index}: reward {prompt.reward!r} raised "
            f"{type(exc).__name__}: {exc} (completion {completion[:80]!r})"
        ) from exc
    return check_reward(prompt, value)


def _score(prompt: Prompt, completion: str) -> Any:
    reward = prompt.reward
    if reward == "exact":
        return exact_reward(completion, prompt.answer)
    if reward == "regex":
        return regex_reward(completion, prompt.answer, prompt.reward_pattern)
    if reward == "math":
        return math_reward(completion, prompt.answer)
    if reward == "reasoning_gym":
        scorer = reasoning_gym_scorer(prompt.task, prompt.task_args_json)
        return scorer.score_answer(answer=extract_answer(completion), entry=prompt.entry)
    function = load_user_reward(reward)
    return function(completion, prompt.answer, prompt.entry)


def check_reward(prompt: Prompt, value: Any) -> float:
    """`value` as a float when it is a finite real number in [0, 1] (bool refused).

    Raises:
        RewardError: NaN, ±inf, out of [0, 1], or not a number; names the source, the row and the reward.
    """
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if ok and math.isfinite(value) and 0.0 <= value <= 1.0:
        return float(value)
    raise RewardError(
        f"source {prompt.source!r}, row {prompt.index}: reward {prompt.reward!r} returned {value!r}; "
        "expected a finite number in [0, 1] (1.0 counts as correct)"
    )


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
