"""Built-in verifiers: a completion and a reference answer → a reward in [0, 1].

- `exact`: the answer part of the completion (`extract_answer`: the last `<answer>…</answer>` span, else
  the whole completion), stripped, equals the stripped reference: 1.0, else 0.0.
- `regex`: the last match of the source's `reward_pattern` in the completion (its first group when the
  pattern has groups), stripped, equals the stripped reference (lm-evaluation-harness's "regex" filter
  followed by its exact match).
- `math`: the final answers are equal as mathematical objects, by Hugging Face's `math-verify`
  (`parse` then `verify`: LaTeX and plain expressions through SymPy, numbers compared after rounding to
  6 decimals; `\\boxed{}` takes priority, `1,234` is 1234, `\\frac{1}{2}` is 0.5). Before parsing, a
  GSM8K-style `#### N` keeps only what follows the last `####`, in the completion and in the reference
  alike (GSM8K's reference answers are the worked solution ending in `#### N`).
- a user's function by import path `module:function` (`load_user_reward`), called as
  `function(completion, answer, entry) -> float` (signature below).

Which one scores a prompt is its source's `reward` field (`mopd_hpc.data.rewards.score_completion`).
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Callable
from typing import Any

from mopd_hpc.data.errors import DataSourceError

_ANSWER_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", flags=re.DOTALL)
_GSM8K_MARK = "####"
#: math-verify's own time limit on one parse or comparison (seconds), where it can set one: its limit
#: is a SIGALRM, which only the main thread may install; elsewhere it runs without one.
MATH_TIMEOUT_S = 5

UserReward = Callable[[str, str, dict[str, Any]], float]
"""A user's reward function: `fn(completion, answer, entry) -> float`.

    completion: the decoded response (special tokens skipped, not stripped), e.g. `"... #### 72"`.
    answer: the row's reference answer (`answer` of a jsonl row; reasoning-gym's `answer`).
    entry: the whole row as a dict (a jsonl row's every key, `prompt` included; reasoning-gym's
        `question`, `answer`, `metadata`); a fresh copy on every call.
    returns: a finite number in [0, 1]; exactly 1.0 counts as correct for accuracy. Anything else
        (NaN, ±inf, out of range, not a number, an exception) stops the step with an error that names
        the source and the row.
"""


def extract_answer(completion: str) -> str:
    """The answer part of a decoded completion: the last `<answer>…</answer>` span, else all; stripped."""
    tagged = _ANSWER_TAG.findall(completion)
    return (tagged[-1] if tagged else completion).strip()


def exact_reward(completion: str, answer: str) -> float:
    """1.0 when `extract_answer(completion)` equals `answer.strip()`, else 0.0."""
    return 1.0 if extract_answer(completion) == answer.strip() else 0.0


def regex_reward(completion: str, answer: str, pattern: str) -> float:
    """1.0 when the last match of `pattern` in `completion` (its first group, if any), stripped, equals
    `answer.strip()`; 0.0 otherwise, and when nothing matches."""
    matches = re.findall(pattern, completion)
    if not matches:
        return 0.0
    last = matches[-1]
    found = last[0] if isinstance(last, tuple) else last
    return 1.0 if found.strip() == answer.strip() else 0.0


def final_math_answer(text: str) -> str:
    """What `math_reward` parses: the `<answer>` span (`extract_answer`), then what follows the last
    `####` when there is one and no `\\boxed{` (GSM8K's final-answer mark), e.g. `so 3 #### 1,234` → `1,234`."""
    text = extract_answer(text)
    if _GSM8K_MARK in text and "\\boxed" not in text:
        text = text.rsplit(_GSM8K_MARK, 1)[1].strip()
    return text


def math_reward(completion: str, answer: str) -> float:
    """1.0 when the final answers of `completion` and `answer` are equal by math-verify, else 0.0.

    A completion with no parseable answer (e.g. `\\boxed{` unclosed, empty) scores 0.0.

    Raises:
        DataSourceError: the reference answer itself holds no parseable mathematical answer.
    """
    from math_verify import parse, verify  # deferred: imports SymPy and an ANTLR parser (≈ 0.5 s)

    timeout = MATH_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = parse(final_math_answer(answer), parsing_timeout=timeout)
    if not gold:  # `parses_as_math` is this test, for `mopd-data check --reward math`
        raise DataSourceError(
            f"reward math: the reference answer {answer[:80]!r} holds no number or expression that "
            "math-verify parses; expected e.g. '72', '#### 1,234', '\\boxed{\\frac{1}{2}}'"
        )
    pred = parse(final_math_answer(completion), parsing_timeout=timeout)
    if not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=timeout) else 0.0


def parses_as_math(answer: str) -> bool:
    """Whether `math_reward` can read a reference answer (its final answer parses with math-verify)."""
    from math_verify import parse

    timeout = MATH_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    return bool(parse(final_math_answer(answer), parsing_timeout=timeout))


@functools.cache
def load_user_reward(path: str) -> UserReward:
    """The user's reward function named by `path` (`module:function`), imported once per process.

    Raises:
        DataSourceError: the path is malformed, its module does not import, or it names no callable.
    """
    from mopd_hpc.config.rewards import ImportPathError, load_object  # deferred: the config package, ≈ 0.4 s

    try:
        return load_object(path)
    except ImportPathError as exc:
        raise DataSourceError(f"reward {path!r}: {exc}") from exc
