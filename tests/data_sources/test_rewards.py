"""Rewards: the built-in verifiers on right, wrong and malformed answers; a user's reward by import path;
the range and NaN check naming the source and the row; a bad reward path refused by `mopd-submit --check`
naming the field."""

from __future__ import annotations

import math
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
from test_cli_check import mopd_submit

from mopd_hpc.config import ConfigError, load_run_config
from mopd_hpc.data import Prompt, score_completion
from mopd_hpc.data.errors import DataSourceError, PromptRecordError, RewardError
from mopd_hpc.data.verifiers import final_math_answer

REPO = Path(__file__).resolve().parents[2]


def jsonl_prompt(answer: str, reward: str | None, pattern: str = "", index: int = 3) -> Prompt:
    return Prompt.create(
        kind="jsonl",
        source="gsm8k",
        index=index,
        text="q",
        answer=answer,
        entry={"prompt": "q", "answer": answer, "level": 2},
        reward=reward,
        reward_pattern=pattern,
    )


@pytest.mark.parametrize(
    ("answer", "completion", "expected"),
    [
        ("1234", "so the total is #### 1,234", 1.0),  # GSM8K mark, thousands separator
        ("#### 1,234", "1234", 1.0),  # the reference in GSM8K's own form
        ("Natalia sold 24 in May.\n#### 72", "48+24=72 #### 72", 1.0),  # a worked reference
        ("0.5", "the answer is \\boxed{\\frac{1}{2}}", 1.0),  # boxed fraction == decimal
        ("\\frac{1}{2}", "so 0.5", 1.0),
        ("14", "5+1+8=14", 1.0),  # no mark: the last number
        ("14", "<answer>14</answer>", 1.0),
        ("1234", "#### 1,235", 0.0),  # wrong
        ("0.5", "\\boxed{\\frac{1}{3}}", 0.0),
        ("72", "#### 72 is wrong, it is #### 70", 0.0),  # the last mark counts
        ("14", "\\boxed{", 0.0),  # malformed: nothing parses
        ("14", "", 0.0),
        ("14", "no number here", 0.0),
    ],
)
def test_math_verifier(answer: str, completion: str, expected: float) -> None:
    assert score_completion(jsonl_prompt(answer, "math"), completion) == expected


def test_math_final_answer_takes_what_follows_the_last_mark() -> None:
    assert final_math_answer("a #### 3\n b #### 1,234 ") == "1,234"
    assert final_math_answer("#### 2 \\boxed{3}") == "#### 2 \\boxed{3}"  # boxed wins: left to math-verify


def test_math_verifier_refuses_a_reference_without_a_number_naming_source_and_row() -> None:
    with pytest.raises(RewardError, match=r"source 'gsm8k', row 3: reward 'math' raised .*no number"):
        score_completion(jsonl_prompt("no answer here", "math"), "14")


@pytest.mark.parametrize(
    ("answer", "completion", "expected"),
    [("14", " 14 ", 1.0), ("14", "<answer> 14 </answer>", 1.0), ("14", "014", 0.0), ("14", "", 0.0)],
)
def test_exact_verifier_is_the_jsonl_default(answer: str, completion: str, expected: float) -> None:
    assert score_completion(jsonl_prompt(answer, "exact"), completion) == expected
    assert jsonl_prompt(answer, None).reward == "exact"
    assert score_completion(jsonl_prompt(answer, None), completion) == expected


@pytest.mark.parametrize(
    ("pattern", "completion", "expected"),
    [
        (r"Answer: (\S+)", "Answer: 3 ... Answer: 14", 1.0),  # the last match's first group
        (r"Answer: (\S+)", "Answer: 14 then Answer: 15", 0.0),
        (r"Answer: (\S+)", "14", 0.0),  # no match
        (r"\d+", "x 7 y 14", 1.0),  # no group: the whole match
    ],
)
def test_regex_verifier(pattern: str, completion: str, expected: float) -> None:
    assert score_completion(jsonl_prompt("14", "regex", pattern), completion) == expected


def test_reasoning_gym_scorer_is_the_reasoning_gym_default() -> None:
    from mopd_hpc.data import ReasoningGymSource

    src = ReasoningGymSource.create("c", "chain_sum", {"min_terms": 2, "max_terms": 2}, size=2)
    p = src[0]
    assert p.reward == "reasoning_gym"
    assert src.score(p, p.answer) == 1.0 and src.score(p, "x") == 0.0
    with pytest.raises(PromptRecordError, match="reasoning-gym prompts only"):
        Prompt.create(kind="jsonl", source="s", index=0, text="q", answer="1", reward="reasoning_gym")


USER_MODULE = '''
import math

def length_reward(completion, answer, entry):
    """1.0 when the completion is as long as the answer, times the row's level / 2."""
    return (len(completion.strip()) == len(answer)) * entry["level"] / 2

def nan_reward(completion, answer, entry):
    return math.nan

def big_reward(completion, answer, entry):
    return 2

def failing_reward(completion, answer, entry):
    raise KeyError("score")

not_callable = 3
'''


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_a_user_reward_by_import_path(user_module: Path) -> None:
    prompt = jsonl_prompt("abc", "my_rewards:length_reward")
    assert score_completion(prompt, " xyz ") == 1.0  # len 3 == len("abc"), level 2 / 2
    assert score_completion(prompt, "xy") == 0.0


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ("nan_reward", r"returned nan; expected a finite number in \[0, 1\]"),
        ("big_reward", r"returned 2; expected a finite number in \[0, 1\]"),
        ("failing_reward", r"raised KeyError: 'score'"),
    ],
)
def test_a_bad_reward_names_the_source_and_the_row(user_module: Path, function: str, message: str) -> None:
    prompt = jsonl_prompt("abc", f"my_rewards:{function}", index=7)
    with pytest.raises(
        RewardError, match=rf"source 'gsm8k', row 7: reward 'my_rewards:{function}' {message}"
    ):
        score_completion(prompt, "abc")


def test_a_reward_path_that_does_not_import_is_a_data_error() -> None:
    with pytest.raises(DataSourceError, match="module 'no_such_mod_xyz' does not import"):
        score_completion(jsonl_prompt("1", "no_such_mod_xyz:f"), "1")
    assert not math.isnan(score_completion(jsonl_prompt("1", "exact"), "1"))


def test_config_refuses_bad_reward_fields_naming_each(user_module: Path) -> None:
    sets = {
        "data.sources[0].reward=my_rewards:missing": "data.sources[0].reward: module 'my_rewards' has no attribute 'missing'",
        "data.sources[0].reward=my_rewards:not_callable": "data.sources[0].reward: 'my_rewards:not_callable' is a int, not a callable",
        "data.sources[0].reward=no_colon": "data.sources[0].reward: not an import path",
        "data.sources[1].reward=regex": "data.sources[1].reward_pattern: reward 'regex' needs a pattern",
        "data.sources[1].reward_pattern=x": "data.sources[1].reward_pattern: applies to reward 'regex' only",
        "data.sources[1].reward=regex,data.sources[1].reward_pattern=''": "data.sources[1].reward_pattern: reward 'regex' needs a pattern (got ''; a Python regex)",
        "data.sources[1].reward=regex,data.sources[1].reward_pattern='('": "data.sources[1].reward_pattern: not a valid regex",
        "data.sources[0].system_prompt=hi": "data.sources[0].system_prompt: applies to template 'chat' only",
    }
    for override, message in sets.items():
        with pytest.raises(ConfigError) as err:
            load_run_config(
                REPO / "configs" / "local_cpu.yaml", overrides=override.split(","), force_local=True
            )
        assert message in str(err.value), (override, str(err.value))
    good = load_run_config(
        REPO / "configs" / "local_cpu.yaml",
        overrides=["data.sources[0].reward=my_rewards:length_reward", "data.sources[1].reward=math"],
        force_local=True,
    )
    assert [s.reward for s in good.data.sources] == ["my_rewards:length_reward", "math"]


def check(*sets: str) -> subprocess.CompletedProcess[str]:
    return mopd_submit("--check", "configs/local_cpu.yaml", *(a for s in sets for a in ("--set", s)))


def test_check_refuses_a_bad_reward_path_naming_the_field_and_accepts_a_good_one(
    user_module: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = check("data.sources[0].reward=my_rewards_absent:score")
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert "data.sources[0].reward: module 'my_rewards_absent' does not import" in bad.stderr
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(user_module), os.environ.get("PYTHONPATH", "")]))
    good = check("data.sources[0].reward=my_rewards:length_reward")
    assert good.returncode == 0, good.stdout + good.stderr
    assert "my_rewards:length_reward" in good.stdout
