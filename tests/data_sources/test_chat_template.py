"""Prompts through the tokenizer's chat template: the project's character-level tokenizer given a Jinja chat
template (no download), saved as the student's and a teacher's tokenizer; the templated ids are the same from
both, equal to the ids written out by hand, and what the rollout phase and the greedy evaluation send."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from mopd_hpc.data import JsonlSource, Prompt
from mopd_hpc.data.chat import chat_messages, encode_prompt, render_prompt
from mopd_hpc.data.errors import DataSourceError
from mopd_hpc.data.scoring import Scoring
from mopd_hpc.data.tokenizer import BOS_ID, build_char_tokenizer, char_vocab, save_char_tokenizer
from mopd_hpc.mopd.compatibility import tokenizer_fingerprint
from mopd_hpc.mopd.routing import RoutedSample
from mopd_hpc.trainer.rollout_phase import encode_prompts as rollout_encode

#: A chat template in the tokenizer's alphabet, with a switch of its own as Qwen3's `enable_thinking` is.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }} {{ m['content'] }},{% endfor %}"
    "{% if add_generation_prompt %}assistant {% if enable_thinking is defined and not enable_thinking %}"
    "nothink {% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tok")
    for name in ("student", "teacher"):
        tok = build_char_tokenizer()
        tok.chat_template = TEMPLATE
        save_char_tokenizer(tok, root / name)
    return root / "student", root / "teacher"


def chars(text: str) -> list[int]:
    vocab = char_vocab()
    return [vocab[c] for c in text]


def chat_prompt(text: str, system: str | None, kwargs: dict) -> Prompt:
    return Prompt.create(
        kind="jsonl",
        source="sums",
        index=0,
        text=text,
        answer="6",
        chat={"system": system, "kwargs": kwargs},
    )


def test_student_and_teacher_tokenizers_give_the_same_templated_ids(tokenizer_dirs) -> None:
    student, teacher = (AutoTokenizer.from_pretrained(d) for d in tokenizer_dirs)
    assert student.chat_template == TEMPLATE == teacher.chat_template  # saved and loaded back
    assert tokenizer_fingerprint(tokenizer_dirs[0]).digest == tokenizer_fingerprint(tokenizer_dirs[1]).digest
    prompt = chat_prompt("5+1=", "be brief", {"enable_thinking": False})
    ids = encode_prompt(student, prompt)
    assert ids == encode_prompt(teacher, prompt)
    # the template writes <bos> itself; no second one from the tokenizer's post-processor
    assert ids == [BOS_ID, *chars("system be brief,user 5+1=,assistant nothink ")]
    assert render_prompt(student, prompt) == "<bos>system be brief,user 5+1=,assistant nothink "
    # HF's own tokenize=True path gives the same ids
    hf = student.apply_chat_template(chat_messages(prompt), add_generation_prompt=True, enable_thinking=False)
    assert list(hf if isinstance(hf, list) else hf["input_ids"]) == ids


def test_the_template_switch_and_the_system_prompt_change_the_ids(tokenizer_dirs) -> None:
    tok = AutoTokenizer.from_pretrained(tokenizer_dirs[0])
    thinking = encode_prompt(tok, chat_prompt("5+1=", None, {}))
    assert thinking == [BOS_ID, *chars("user 5+1=,assistant ")]
    raw = Prompt.create(kind="jsonl", source="sums", index=0, text="5+1=", answer="6")
    assert encode_prompt(tok, raw) == [BOS_ID, *chars("5+1=")]  # raw: unchanged, special tokens added


def test_a_chat_jsonl_source_reaches_the_rollout_phase_templated(tokenizer_dirs, tmp_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tokenizer_dirs[0])
    path = tmp_path / "sums.jsonl"
    path.write_text(
        "\n".join(json.dumps({"prompt": p, "answer": a}) for p, a in [("1+2=", "3"), ("2+2=", "4")])
    )
    scoring = Scoring(
        reward="math", template="chat", system_prompt="add", chat_template_kwargs={"enable_thinking": False}
    )
    source = JsonlSource.from_path("sums", path, scoring)
    assert source[1].reward == "math" and source[1].chat == {
        "system": "add",
        "kwargs": {"enable_thinking": False},
    }
    draws = [RoutedSample("math", "sums", i, source[i]) for i in range(2)]
    ids = rollout_encode(tok, draws, max_prompt_tokens=64)
    assert ids == [[BOS_ID, *chars(f"system add,user {p},assistant nothink ")] for p in ("1+2=", "2+2=")]


def test_a_chat_prompt_needs_a_tokenizer_with_a_chat_template() -> None:
    with pytest.raises(DataSourceError, match="template 'chat' but the tokenizer .* has no chat_template"):
        encode_prompt(build_char_tokenizer(), chat_prompt("1+1=", None, {}))


def test_check_refuses_a_chat_source_whose_tokenizer_has_no_template(tokenizer_dirs, tmp_path: Path) -> None:
    from mopd_hpc.config import load_run_config
    from mopd_hpc.data.chat import has_chat_template
    from mopd_hpc.launch.model_check import chat_template_problems

    plain = tmp_path / "plain"
    save_char_tokenizer(build_char_tokenizer(), plain)
    assert has_chat_template(tokenizer_dirs[0]) and not has_chat_template(plain)
    repo = Path(__file__).resolve().parents[2]
    cfg = load_run_config(
        repo / "configs" / "local_cpu.yaml", overrides=["data.sources[1].template=chat"], force_local=True
    )
    assert chat_template_problems(cfg, tokenizer_dirs[0]) == []
    (problem,) = chat_template_problems(cfg, plain)
    assert problem.render() == (
        f"data.sources[1].template: the tokenizer (models.tokenizer.path: {plain}) holds no chat template "
        "(got 'chat'; template: raw, or a tokenizer whose tokenizer_config.json (or chat_template.jinja) holds one)"
    )
    raw = load_run_config(repo / "configs" / "local_cpu.yaml", force_local=True)
    assert chat_template_problems(raw, plain) == []
