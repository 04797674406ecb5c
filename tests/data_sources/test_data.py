"""Dataset sources, prompt formatting and rewards (mopd_hpc.data), against real reasoning-gym."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import reasoning_gym
from reasoning_gym.arithmetic.leg_counting import ANIMALS

from mopd_hpc.data import (
    EVAL_SEED_OFFSET,
    SPLIT_SPAN,
    DataSourceError,
    JsonlFormatError,
    JsonlSource,
    Prompt,
    PromptRecordError,
    PromptSource,
    ReasoningGymSource,
    SourceIndexError,
    extract_answer,
    format_prompt,
    is_correct,
    make_source,
    score_completion,
)

CHAIN_ARGS = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}
LEGS_ARGS = {"min_animals": 1, "max_animals": 2, "min_instances": 1, "max_instances": 5}


@pytest.fixture(scope="module")
def chain() -> ReasoningGymSource:
    return ReasoningGymSource.create("chain", "chain_sum", CHAIN_ARGS, seed=0)


@pytest.fixture(scope="module")
def legs() -> ReasoningGymSource:
    return ReasoningGymSource.create("legs", "leg_counting", LEGS_ARGS, seed=0)


# --- prompt text ---------------------------------------------------------------------------------


def test_chain_sum_prompt_is_the_expression_without_spaces(chain: ReasoningGymSource) -> None:
    assert format_prompt("chain_sum", {"metadata": {"expression": "5 + 1 + 8"}}) == "5+1+8="
    for i in range(200):
        p = chain[i]
        assert re.fullmatch(r"\d[+-]\d([+-]\d)?=", p.text), p.text
        assert eval(p.text[:-1]) == int(p.answer)  # the expression itself is the oracle
        assert p.text[:-1] in p.entry["question"].replace(" ", "")


def test_leg_counting_prompt_is_the_animal_list(legs: ReasoningGymSource) -> None:
    entry = {"metadata": {"animals": {"woodlouse": 3, "ant": 1}}}
    assert format_prompt("leg_counting", entry) == "3 woodlouses, 1 ant="
    for i in range(200):
        p = legs[i]
        listed = re.search(r"if you have (.+)\?", p.entry["question"]).group(1)
        assert p.text == listed + "="
        assert int(p.answer) == sum(n * ANIMALS[a] for a, n in p.entry["metadata"]["animals"].items())


def test_unknown_task_falls_back_to_the_question() -> None:
    src = ReasoningGymSource.create("arith", "basic_arithmetic", {}, seed=3, size=5)
    reference = reasoning_gym.create_dataset("basic_arithmetic", seed=3, size=5)
    assert [src[i].text for i in range(5)] == [reference[i]["question"] for i in range(5)]


def test_formatter_names_a_missing_metadata_key() -> None:
    with pytest.raises(DataSourceError, match=r"leg_counting entry: metadata\['animals'\] is missing"):
        format_prompt("leg_counting", {"question": "q", "metadata": {}})


# --- rewards: the datasets' own score_answer -----------------------------------------------------


def test_rewards_on_correct_and_incorrect_answers(
    chain: ReasoningGymSource, legs: ReasoningGymSource
) -> None:
    for src in (chain, legs):
        dataset = reasoning_gym.create_dataset(src.task, seed=0, size=10, **src.task_args)
        for i in range(10):
            p = src[i]
            wrong = str(int(p.answer) + 1)
            assert score_completion(p, p.answer) == 1.0
            assert src.score(p, f" {p.answer}\n") == 1.0
            assert score_completion(p, f"<answer>{p.answer}</answer>") == 1.0
            assert score_completion(p, wrong) == dataset.score_answer(wrong, dataset[i]) == 0.0
            assert score_completion(p, "") == 0.0
    p = chain[0]  # "0-4-8=" -> "-12"
    assert p.answer == "-12"
    assert score_completion(p, "-012.0") == 1.0  # chain_sum's decimal tolerance
    q = legs[1]  # "1 woodlouse=" -> "14"; leg_counting scores by the base class: partial credit
    assert (q.text, q.answer) == ("1 woodlouse=", "14")
    assert score_completion(q, "+014") == 0.5
    assert not is_correct(score_completion(q, "+014")) and is_correct(score_completion(q, "14"))


def test_extract_answer() -> None:
    assert extract_answer("  42 \n") == "42"
    assert extract_answer("think <answer>1</answer> then <answer> 7 </answer>") == "7"


# --- held-out split --------------------------------------------------------------------------------


def test_held_out_split_uses_disjoint_rng_seeds(chain: ReasoningGymSource) -> None:
    held_out = chain.held_out(1000)
    assert (held_out.split, held_out.name, len(held_out)) == ("eval", "chain/eval", 1000)
    assert held_out.rng_seeds == range(EVAL_SEED_OFFSET, EVAL_SEED_OFFSET + 1000)
    assert chain.rng_seeds == range(0, 10**9)
    assert (
        ReasoningGymSource.create("c", "chain_sum", CHAIN_ARGS, size=SPLIT_SPAN).rng_seeds[-1]
        < EVAL_SEED_OFFSET
    )
    reference = reasoning_gym.create_dataset("chain_sum", seed=EVAL_SEED_OFFSET, size=5, **CHAIN_ARGS)
    assert [held_out[i].entry["question"] for i in range(5)] == [reference[i]["question"] for i in range(5)]
    with pytest.raises(DataSourceError, match="held_out\\(\\) of an eval split"):
        held_out.held_out()


def test_held_out_prompts_are_disjoint_where_the_problem_space_is_large() -> None:
    args = {"min_terms": 4, "max_terms": 5, "min_digits": 3, "max_digits": 4}
    train = ReasoningGymSource.create("big", "chain_sum", args, seed=0)
    held_out = train.held_out(300)
    assert {train[i].text for i in range(300)}.isdisjoint(held_out[i].text for i in range(300))


def test_neighbouring_seeds_would_overlap_which_the_rule_avoids() -> None:
    # The calibration's caveat: item i of seed s is Random(s + i), so seed 1 repeats seed 0 shifted by one.
    a = ReasoningGymSource.create("a", "chain_sum", CHAIN_ARGS, seed=0, size=50)
    b = ReasoningGymSource.create("b", "chain_sum", CHAIN_ARGS, seed=1, size=50)
    assert [a[i + 1].text for i in range(49)] == [b[i].text for i in range(49)]


# --- determinism, records, indexing ------------------------------------------------------------------


def test_same_arguments_give_the_same_prompts_in_another_process(legs: ReasoningGymSource) -> None:
    code = (
        "import json; from mopd_hpc.data import ReasoningGymSource as S;"
        f"s = S.create('legs', 'leg_counting', {LEGS_ARGS!r}, seed=0);"
        "print(json.dumps([s[i].to_dict() for i in range(20)]))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert [Prompt.from_dict(d) for d in json.loads(out)] == [legs[i] for i in range(20)]
    again = ReasoningGymSource.create("legs", "leg_counting", LEGS_ARGS, seed=0)
    assert [again[i] for i in range(50)] == [legs[i] for i in range(50)]
    assert ReasoningGymSource.create("legs", "leg_counting", LEGS_ARGS, seed=5)[0] != legs[0]


def test_prompt_record_round_trips_through_json_and_is_hashable(chain: ReasoningGymSource) -> None:
    p = chain[7]
    restored = Prompt.from_dict(json.loads(json.dumps(p.to_dict())))
    assert restored == p and hash(restored) == hash(p)
    assert (p.kind, p.source, p.index, p.task, p.task_args) == (
        "reasoning_gym",
        "chain",
        7,
        "chain_sum",
        CHAIN_ARGS,
    )
    assert score_completion(restored, p.answer) == 1.0


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"kind": "csv"}, r"Prompt.kind: unknown kind \(got 'csv'"),
        ({"index": -1}, r"Prompt.index: must be an int >= 0 \(got -1\)"),
        ({"text": ""}, r"Prompt.text: must not be empty"),
        ({"task": ""}, r"Prompt.task: a reasoning_gym prompt needs a task name"),
        ({"entry_json": "[1]"}, r"Prompt.entry_json: must encode a JSON object \(got \[1\]\)"),
        ({"task_args_json": "{"}, r"Prompt.task_args_json: not valid JSON"),
    ],
)
def test_prompt_validation_names_the_field(chain: ReasoningGymSource, changes: dict, message: str) -> None:
    with pytest.raises(PromptRecordError, match=message):
        Prompt(**{**chain[0].to_dict(), **changes})


def test_prompt_from_dict_names_missing_and_unknown_keys(chain: ReasoningGymSource) -> None:
    data = chain[0].to_dict()
    del data["answer"]
    with pytest.raises(PromptRecordError, match=r"missing keys \['answer'\], unknown keys \['route'\]"):
        Prompt.from_dict({**data, "route": "chain"})


def test_sources_are_indexable_and_iteration_stops_at_len() -> None:
    src = ReasoningGymSource.create("small", "chain_sum", CHAIN_ARGS, seed=0, size=3)
    assert isinstance(src, PromptSource) and len(src) == 3
    assert [p.index for p in src] == [0, 1, 2]
    for bad in (3, -1):
        with pytest.raises(
            SourceIndexError,
            match=rf"source 'small': index {bad} out of range \(expected an int in \[0, 3\)\)",
        ):
            src[bad]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "parquet", "task": "chain_sum"}, r"kind: unknown kind 'parquet'"),
        (
            {"kind": "reasoning_gym", "task": "no_such_task"},
            r"unknown task 'no_such_task' \(known: .*chain_sum",
        ),
        (
            {"kind": "reasoning_gym", "task": "chain_sum", "task_args": {"max_term": 3}},
            r"task_args of 'chain_sum': rejected",
        ),
        (
            {"kind": "reasoning_gym", "task": "chain_sum", "task_args": {"min_terms": 0}},
            r"rejected by reasoning-gym: min_terms must be positive",
        ),
        (
            {"kind": "reasoning_gym", "task": "chain_sum", "task_args": {"seed": 1}},
            r"\['seed'\] are set by the source",
        ),
        (
            {"kind": "reasoning_gym", "task": "chain_sum", "seed": -1},
            r"seed: expected an int in \[0, \d+\) \(got -1\)",
        ),
        (
            {"kind": "reasoning_gym", "task": "chain_sum", "size": 0},
            r"size: expected an int in \[1, \d+\] \(got 0\)",
        ),
        ({"kind": "reasoning_gym", "task": "chain_sum", "split": "test"}, r"split: unknown split 'test'"),
        ({"kind": "reasoning_gym", "path": "x.jsonl"}, r"kind reasoning_gym needs `task` and no `path`"),
        ({"kind": "jsonl", "task": "chain_sum"}, r"kind jsonl needs `path`"),
        ({"kind": "jsonl", "path": "x.jsonl", "split": "eval"}, r"a jsonl source has no 'eval' split"),
    ],
)
def test_make_source_errors_name_the_field_and_value(kwargs: dict, message: str) -> None:
    with pytest.raises(DataSourceError, match=message):
        make_source(name="s", **kwargs)


# --- jsonl source ------------------------------------------------------------------------------------------


def test_jsonl_source_reads_prompts_and_scores_exact_match(tmp_path) -> None:
    path = tmp_path / "mine.jsonl"
    path.write_text(
        '{"prompt": "2+2=", "answer": "4"}\n\n{"prompt": "capital of france?", "answer": " paris ", "id": 9}\n'
    )
    src = make_source("jsonl", "mine", path=path)
    assert isinstance(src, JsonlSource) and isinstance(src, PromptSource) and len(src) == 2
    assert [(p.text, p.answer, p.index, p.kind) for p in src] == [
        ("2+2=", "4", 0, "jsonl"),
        ("capital of france?", " paris ", 1, "jsonl"),
    ]
    assert src[1].entry["id"] == 9
    assert src.score(src[0], " 4\n") == 1.0 and src.score(src[0], "4.0") == 0.0
    assert src.score(src[1], "paris") == 1.0 and src.score(src[1], "Paris") == 0.0
    assert Prompt.from_dict(json.loads(json.dumps(src[1].to_dict()))) == src[1]


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ("{not json", r"not valid JSON"),
        ('["2+2=", "4"]', r"expected a JSON object \(got list"),
        ('{"answer": "4"}', r"'prompt' must be a non-empty string \(got None\)"),
        ('{"prompt": "", "answer": "4"}', r"'prompt' must be a non-empty string \(got ''\)"),
        ('{"prompt": "2+2=", "answer": 4}', r"'answer' must be a string \(got 4\)"),
    ],
)
def test_jsonl_bad_line_names_file_and_line(tmp_path, bad_line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n\n' + bad_line + "\n")
    with pytest.raises(JsonlFormatError, match=rf"^{re.escape(str(path))}:3: {message}") as info:
        make_source("jsonl", "bad", path=path)
    assert (info.value.path, info.value.line_no) == (str(path), 3)


def test_jsonl_empty_or_missing_file_is_an_error(tmp_path) -> None:
    (tmp_path / "empty.jsonl").write_text("\n \n")
    with pytest.raises(DataSourceError, match=r"holds no prompt"):
        JsonlSource.from_path("e", tmp_path / "empty.jsonl")
    with pytest.raises(DataSourceError, match=r"cannot read jsonl file .*nope.jsonl"):
        JsonlSource.from_path("n", tmp_path / "nope.jsonl")
