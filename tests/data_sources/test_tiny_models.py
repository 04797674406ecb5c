"""tools/build_tiny_models.py: micro builds (seconds), HF loading, caching, determinism, greedy evaluation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers_models import BUILDER_PATH, MODEL_NAMES, build_micro_models, load_builder
from transformers import AutoModelForCausalLM, AutoTokenizer

from mopd_hpc.data import ReasoningGymSource
from mopd_hpc.data.evaluation import evaluate_source, greedy_complete
from mopd_hpc.data.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    VOCAB_SIZE,
    build_char_tokenizer,
    tokenizer_fingerprint,
)

builder = load_builder()


@pytest.fixture(scope="module")
def micro_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """Micro models built once through the real CLI (a subprocess, one thread); returns (dir, stdout)."""
    out = tmp_path_factory.mktemp("micro") / "models"
    proc = subprocess.run(
        [sys.executable, str(BUILDER_PATH), "--out", str(out), "--micro", "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return out, proc.stdout


def test_micro_build_writes_hf_checkpoints_and_build_records(micro_dir: tuple[Path, str]) -> None:
    out, stdout = micro_dir
    for name in MODEL_NAMES:
        files = {p.name for p in (out / name).iterdir()}
        assert set(builder.MODEL_FILES) | {"build.json"} <= files, files
        record = json.loads((out / name / "build.json").read_text())
        spec = next(s for s in builder.MICRO_SPECS if s.name == name)
        assert record["name"] == name
        assert record["fingerprint"] == builder.build_fingerprint(spec, record["tokenizer_fingerprint"])
        assert set(record["accuracy"]) == set(spec.tasks)
        assert all(0.0 <= a <= 1.0 for a in record["accuracy"].values())
        assert record["seconds"] >= record["train_seconds"] >= 0
        assert record["spec"]["steps"] == spec.steps and record["threads"] == 1
        assert f"\n{name} " in stdout and "built" in stdout.split(f"\n{name} ")[1].splitlines()[0]


def test_models_load_with_auto_classes(micro_dir: tuple[Path, str]) -> None:
    out, _ = micro_dir
    for name in MODEL_NAMES:
        model = AutoModelForCausalLM.from_pretrained(out / name)
        spec = next(s for s in builder.MICRO_SPECS if s.name == name)
        cfg = model.config
        assert (type(model).__name__, cfg.model_type) == ("Qwen3ForCausalLM", "qwen3")
        assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (
            VOCAB_SIZE,
            spec.hidden_size,
            spec.num_layers,
        )
        assert (
            cfg.tie_word_embeddings
            and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        )
        assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
        logits = model(input_ids=torch.tensor([[BOS_ID, 5, 40, 6, 42]])).logits
        assert logits.shape == (1, 5, VOCAB_SIZE) and torch.isfinite(logits).all()


def test_tokenizer_round_trips_prompts(micro_dir: tuple[Path, str]) -> None:
    tok = AutoTokenizer.from_pretrained(micro_dir[0] / "student")
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (
        PAD_ID,
        BOS_ID,
        EOS_ID,
        UNK_ID,
    )
    assert len(tok) == VOCAB_SIZE == 45
    for text in ("5+1+8=", "3 woodlouses, 1 ant=", "-12"):
        ids = tok(text)["input_ids"]
        assert ids[0] == BOS_ID and len(ids) == len(text) + 1  # one token per character after BOS
        assert tok(text, add_special_tokens=False)["input_ids"] == ids[1:]
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert tok.decode(ids + [EOS_ID, PAD_ID]) == "<bos>" + text + "<eos><pad>"
    assert tok("A?", add_special_tokens=False)["input_ids"] == [UNK_ID, UNK_ID]


def test_models_share_the_tokenizer_fingerprint(micro_dir: tuple[Path, str]) -> None:
    out, _ = micro_dir
    loaded = {tokenizer_fingerprint(AutoTokenizer.from_pretrained(out / n)) for n in MODEL_NAMES}
    recorded = {
        json.loads((out / n / "build.json").read_text())["tokenizer_fingerprint"] for n in MODEL_NAMES
    }
    assert len(loaded) == 1 and loaded == recorded
    assert len({(out / n / "tokenizer.json").read_bytes() for n in MODEL_NAMES}) == 1


def test_second_build_is_a_no_op(micro_dir: tuple[Path, str], capsys: pytest.CaptureFixture[str]) -> None:
    out, _ = micro_dir
    before = {n: (out / n / "model.safetensors").stat().st_mtime_ns for n in MODEL_NAMES}
    assert build_micro_models(out) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines if line.split()[0] in MODEL_NAMES] == ["cached"] * 3
    assert {n: (out / n / "model.safetensors").stat().st_mtime_ns for n in MODEL_NAMES} == before


def test_two_builds_give_identical_weights(micro_dir: tuple[Path, str], tmp_path: Path) -> None:
    out, _ = micro_dir
    assert build_micro_models(tmp_path) == 0  # in this process, vs. the fixture's subprocess
    for name in MODEL_NAMES:
        assert (tmp_path / name / "model.safetensors").read_bytes() == (
            out / name / "model.safetensors"
        ).read_bytes()
        assert (tmp_path / name / "config.json").read_bytes() == (out / name / "config.json").read_bytes()


def test_stale_or_missing_build_record_triggers_a_rebuild(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert build_micro_models(tmp_path) == 0
    record_path = tmp_path / "student" / "build.json"
    record = json.loads(record_path.read_text())
    record_path.write_text(json.dumps({**record, "fingerprint": "0" * 64}))  # a spec that changed
    (tmp_path / "teacher_chain_sum" / "build.json").unlink()  # a build that crashed before its record
    capsys.readouterr()
    assert build_micro_models(tmp_path) == 0
    status = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()[1:4]}
    assert status == {"teacher_chain_sum": "built", "teacher_leg_counting": "cached", "student": "built"}
    assert json.loads(record_path.read_text())["fingerprint"] == record["fingerprint"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--threads", "0"], "--threads: expected an int >= 1 (got 0)"),
        (["--only", "teacher_x"], "--only: unknown model(s)"),
    ],
)
def test_usage_errors_exit_2(
    tmp_path: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert builder.main(["--out", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err


def test_real_specs_match_the_calibrated_sizes() -> None:
    from transformers import Qwen3ForCausalLM

    params = {}
    for spec in builder.REAL_SPECS:
        with torch.device("meta"):
            params[spec.name] = sum(
                p.numel() for p in Qwen3ForCausalLM(builder.qwen3_config(spec)).parameters()
            )
    # reference/tiny_calibration.md: teachers 531k parameters, student 134k
    assert params == {"teacher_chain_sum": 530816, "teacher_leg_counting": 530816, "student": 134336}


def test_sft_batch_puts_loss_on_the_answer_and_eos_only() -> None:
    tok = build_char_tokenizer()
    chain = ReasoningGymSource.create("chain_sum", "chain_sum", builder.TASK_ARGS["chain_sum"])
    legs = ReasoningGymSource.create("leg_counting", "leg_counting", builder.TASK_ARGS["leg_counting"])
    input_ids, labels = builder.sft_batch([chain, legs], step=1, batch_size=4, tokenizer=tok)
    prompts = [chain[2], chain[3], legs[2], legs[3]]
    assert input_ids.shape == labels.shape and input_ids.shape[0] == 4
    for row, p in enumerate(prompts):
        p_ids = tok(p.text, add_special_tokens=False)["input_ids"]
        a_ids = tok(p.answer, add_special_tokens=False)["input_ids"] + [EOS_ID]
        n = 1 + len(p_ids) + len(a_ids)
        assert input_ids[row, :n].tolist() == [BOS_ID, *p_ids, *a_ids]
        assert (input_ids[row, n:] == PAD_ID).all()
        assert labels[row, 1 + len(p_ids) : n].tolist() == a_ids
        assert (labels[row, : 1 + len(p_ids)] == builder.IGNORE_INDEX).all() and (
            labels[row, n:] == builder.IGNORE_INDEX
        ).all()


def test_batched_greedy_equals_one_prompt_at_a_time(micro_dir: tuple[Path, str]) -> None:
    out, _ = micro_dir
    tok = AutoTokenizer.from_pretrained(out / "teacher_leg_counting")
    model = AutoModelForCausalLM.from_pretrained(out / "teacher_leg_counting")
    legs = ReasoningGymSource.create(
        "legs", "leg_counting", builder.TASK_ARGS["leg_counting"], split="eval", size=12
    )
    texts = [legs[i].text for i in range(12)]  # lengths differ: left padding is exercised
    assert len({len(t) for t in texts}) > 3
    batched = greedy_complete(model, tok, texts, max_new_tokens=5, batch_size=12)
    single = [greedy_complete(model, tok, [t], max_new_tokens=5)[0] for t in texts]
    assert batched == single and all(len(tok(c, add_special_tokens=False)["input_ids"]) <= 5 for c in batched)


def test_shipped_builds_are_the_real_specs_builds() -> None:
    """assets/tiny_models holds one build of every REAL_SPECS model with the spec's current fingerprint (a changed
    spec, task or tokenizer must ship its new build), complete, its weights the recorded parameter count."""
    from safetensors.torch import load_file

    tok_fp = tokenizer_fingerprint(build_char_tokenizer())
    shipped = builder.SHIPPED_DIR
    assert sorted(p.name for p in shipped.iterdir()) == sorted(s.name for s in builder.REAL_SPECS)
    for spec in builder.REAL_SPECS:
        record = builder.read_build_record(shipped / spec.name)
        assert record is not None, spec.name  # every model file present
        assert record["fingerprint"] == builder.build_fingerprint(spec, tok_fp), spec.name
        weights = load_file(str(shipped / spec.name / "model.safetensors"))
        assert sum(t.numel() for t in weights.values()) == record["params"]  # tied embeddings: saved once
        assert record["target_met"] and record["threads"] == 2


def test_a_build_copies_the_shipped_model_of_its_fingerprint_only(
    micro_dir: tuple[Path, str], tmp_path: Path
) -> None:
    """`copy_shipped`: the micro build as the shipped one: copied byte for byte (build.json last) under its own
    fingerprint, refused (None, nothing written) under another's."""
    out, _ = micro_dir
    record = json.loads((out / "student" / "build.json").read_text())
    other = tmp_path / "other"
    other.mkdir()
    assert builder.copy_shipped("student", "0" * 64, other, shipped=out) is None
    assert not any(other.iterdir())
    copied = builder.copy_shipped("student", record["fingerprint"], tmp_path, shipped=out)
    assert copied == {**record, "status": "shipped"}
    for path in (out / "student").iterdir():
        assert (tmp_path / path.name).read_bytes() == path.read_bytes(), path.name


def test_shipped_teachers_meet_their_target_on_held_out_prompts() -> None:
    for name, task in (("teacher_chain_sum", "chain_sum"), ("teacher_leg_counting", "leg_counting")):
        tok = AutoTokenizer.from_pretrained(builder.SHIPPED_DIR / name)
        model = AutoModelForCausalLM.from_pretrained(builder.SHIPPED_DIR / name)
        held_out = ReasoningGymSource.create(task, task, builder.TASK_ARGS[task], split="eval", size=300)
        result = evaluate_source(model, tok, held_out)
        assert result.n == 300 and result.accuracy >= 0.95, (name, result)
