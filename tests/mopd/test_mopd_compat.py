"""Tokenizer and architecture fingerprints on real HF tokenizer directories built in the test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from mopd_hpc.mopd.compatibility import (
    ModelFiles,
    ModelFilesError,
    TokenizerMismatchError,
    architecture_fingerprint,
    check_models,
    first_architecture_difference,
    tokenizer_fingerprint,
)

WORDS = ["<pad>", "<eos>", "<unk>", "one", "two", "three", "plus", "="]
QWEN_LIKE = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 16,
    "torch_dtype": "float32",
    "transformers_version": "5.0.0",
    "_name_or_path": "/somewhere",
    "use_cache": True,
}


def make_model(
    root: Path, name: str, words: list[str] = WORDS, extra: list[str] = (), config: dict | None = None
) -> Path:
    path = root / name
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    if extra:
        fast.add_special_tokens({"additional_special_tokens": list(extra)})
    fast.save_pretrained(str(path))
    (path / "config.json").write_text(json.dumps(config or QWEN_LIKE))
    return path


def test_identical_tokenizers_share_a_fingerprint(tmp_path: Path) -> None:
    a, b = make_model(tmp_path, "a"), make_model(tmp_path, "b")
    fa, fb = tokenizer_fingerprint(a), tokenizer_fingerprint(b)
    assert fa.digest == fb.digest
    assert dict(fa.id_to_token)[3] == "one"
    assert dict(fa.special_ids) == {"bos_token": None, "eos_token": 1, "pad_token": 0, "unk_token": 2}
    report = check_models(ModelFiles("actor", str(a)), [ModelFiles("t1", str(b)), ModelFiles("t2", str(b))])
    assert report.tokenizer_digest == fa.digest
    assert [n for n, _ in report.architecture_digests] == ["actor", "t1", "t2"]


def test_vocab_mismatch_names_both_models_and_first_token(tmp_path: Path) -> None:
    actor = make_model(tmp_path, "actor")
    swapped = WORDS[:4] + ["deux"] + WORDS[5:]
    teacher = make_model(tmp_path, "teacher", words=swapped)
    with pytest.raises(TokenizerMismatchError) as info:
        check_models(ModelFiles("student", str(actor)), [ModelFiles("math", str(teacher))])
    msg = str(info.value)
    assert "'math'" in msg and "'student'" in msg
    assert "token id 4: 'student' has 'two', 'math' has 'deux'" in msg


def test_added_and_special_token_mismatches(tmp_path: Path) -> None:
    actor = make_model(tmp_path, "actor")
    added = make_model(tmp_path, "added", extra=["<think>"])
    with pytest.raises(TokenizerMismatchError, match="token id 8: 'actor' has None, 'added' has '<think>'"):
        check_models(ModelFiles("actor", str(actor)), [ModelFiles("added", str(added))])
    other_eos = make_model(tmp_path, "eos")
    config_file = other_eos / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "eos_token": "<pad>"}))
    with pytest.raises(
        TokenizerMismatchError, match="special token eos_token: 'actor' has id 1, 'eos' has id 0"
    ):
        check_models(ModelFiles("actor", str(actor)), [ModelFiles("eos", str(other_eos))])


def test_architecture_ignores_non_model_keys_and_names_first_differing_key(tmp_path: Path) -> None:
    base = make_model(tmp_path, "base")
    relabelled = make_model(
        tmp_path, "relabelled", config={**QWEN_LIKE, "torch_dtype": "bfloat16", "_name_or_path": "/elsewhere"}
    )
    assert architecture_fingerprint(base).digest == architecture_fingerprint(relabelled).digest
    deeper = make_model(tmp_path, "deeper", config={**QWEN_LIKE, "num_hidden_layers": 4, "vocab_size": 32})
    small_actor = make_model(tmp_path, "actor", config={**QWEN_LIKE, "hidden_size": 32})
    assert (
        first_architecture_difference(
            architecture_fingerprint(base, name="t1"), architecture_fingerprint(deeper, name="t2")
        )
        == "config key 'num_hidden_layers': 't1' has 2, 't2' has 4"
    )
    # teachers of different shapes train together (each runs its own servers): only the tokenizer must match
    report = check_models(
        ModelFiles("actor", str(small_actor)), [ModelFiles("t1", str(base)), ModelFiles("t2", str(deeper))]
    )
    digests = dict(report.architecture_digests)
    assert len({digests["actor"], digests["t1"], digests["t2"]}) == 3


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused(tmp_path: Path) -> None:
    actor = make_model(tmp_path, "actor")
    narrow = make_model(tmp_path, "narrow", config={**QWEN_LIKE, "vocab_size": 4})
    with pytest.raises(
        TokenizerMismatchError, match=r"'narrow' .*vocab_size=4 is smaller than the shared tokenizer's 8 ids"
    ):
        check_models(ModelFiles("actor", str(actor)), [ModelFiles("narrow", str(narrow))])
    broken = make_model(tmp_path, "broken")
    (broken / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelFilesError, match="'broken'.*not a JSON object"):
        check_models(ModelFiles("actor", str(actor)), [ModelFiles("broken", str(broken))])


def test_missing_files_raise_model_files_error(tmp_path: Path) -> None:
    actor = make_model(tmp_path, "actor")
    with pytest.raises(ModelFilesError, match="'ghost'"):
        check_models(ModelFiles("actor", str(actor)), [ModelFiles("ghost", str(tmp_path / "nope"))])
