"""A local CPU job on a jsonl source scored by the math verifier, with the RL term on: `mopd-submit --local`
on micro models whose student was first taught the file's sums, so its answers are right and its mean reward
is not zero. The references are in GSM8K's form (`#### 5`): exact match would score the student's `5` as 0,
the math verifier scores it 1. The same sums are the source's held-out file (`eval_path`), evaluated at the
start and every 2 steps on the rollout engines with the source's reward: eval.json and the metrics hold the
source's route."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from helpers_jobs import submit_local
from helpers_models import load_builder
from test_controller import micro_config

from mopd_hpc.data import JsonlSource, score_completion
from mopd_hpc.data.evaluation import greedy_complete
from mopd_hpc.data.scoring import Scoring
from mopd_hpc.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, build_char_tokenizer, save_char_tokenizer
from mopd_hpc.records.metrics import read_metrics

#: chain_sum-like prompts in the tiny tokenizer's alphabet; references in GSM8K's `#### N` form.
SUMS = [("2+3=", "5"), ("4+4=", "8"), ("1+6=", "7"), ("3+6=", "9")]
STEPS = 3


def teach_student(student_dir: Path, steps: int = 300) -> None:
    """Overwrite the micro student with one SFT-trained on SUMS (`<bos> prompt answer <eos>`, loss on the
    answer and EOS), the builder's micro student architecture; seconds on one core."""
    from transformers import Qwen3ForCausalLM

    builder = load_builder()
    spec = next(s for s in builder.MICRO_SPECS if s.name == "student")
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(builder.qwen3_config(spec))
    rows = [
        (
            [BOS_ID, *tok(p, add_special_tokens=False)["input_ids"]],
            [*tok(a, add_special_tokens=False)["input_ids"], EOS_ID],
        )
        for p, a in SUMS
    ]
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((len(rows), width), PAD_ID)
    labels = torch.full((len(rows), width), -100)
    for i, (p, a) in enumerate(rows):
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        labels[i, len(p) : len(p) + len(a)] = torch.tensor(a)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.save_pretrained(student_dir)
    save_char_tokenizer(tok, student_dir)


@pytest.fixture(scope="module")
def models(micro_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("models") / "micro"
    shutil.copytree(micro_models, out)  # the shared models stay as built: this module trains its own student
    teach_student(out / "student")
    return out


def test_a_jsonl_source_scored_by_the_math_verifier_earns_reward_with_the_rl_term(
    models: Path, tmp_path: Path
):
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": f"#### {a}"}) + "\n" for p, a in SUMS))
    held_out = tmp_path / "sums_eval.jsonl"
    held_out.write_text(data.read_text())
    source = JsonlSource.from_path("sums", data, Scoring(reward="math"))
    # the student answers right before the run: the premise of a non-zero reward
    from transformers import AutoModelForCausalLM, AutoTokenizer

    student = AutoModelForCausalLM.from_pretrained(models / "student")
    completions = greedy_complete(student, AutoTokenizer.from_pretrained(models / "student"), list(source))
    assert [c.strip() for c in completions] == [a for _, a in SUMS]
    assert [score_completion(p, c) for p, c in zip(source, completions, strict=True)] == [1.0] * len(SUMS)
    assert score_completion(JsonlSource.from_path("x", data)[0], "5") == 0.0  # exact match: '5' != '#### 5'

    run_dir = tmp_path / "run"
    config = micro_config(
        models,
        run_dir,
        tmp_path / "c.yaml",
        **{
            "steps": STEPS,
            "data.samples_per_prompt": 2,
            "data.eval.size": len(SUMS),
            "data.eval.interval": 2,
            "loss.estimator": "topk",
            "loss.rl_coefficient": 1.0,
        },
    )
    doc = yaml.safe_load(config.read_text())
    doc["data"]["sources"][0] = {
        "name": "sums",
        "kind": "jsonl",
        "path": str(data),
        "route": "chain",
        "reward": "math",
        "eval_path": str(held_out),
    }
    config.write_text(yaml.safe_dump(doc))
    proc = submit_local(config, cwd=tmp_path, timeout_s=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = read_metrics(run_dir / "metrics.jsonl")
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
    rewards = [line["reward/chain"] for line in lines]
    assert all(0.0 <= r <= 1.0 for r in rewards)
    assert sum(rewards) / len(rewards) >= 0.5, rewards  # sampled at temperature 1 from a taught student
    # the held-out sums, scored by the math verifier: the taught student's greedy answers are right at the start
    record = json.loads((run_dir / "eval.json").read_text())
    assert [point["step"] for point in record["points"]] == [0, 2, STEPS]
    assert record["points"][0]["pass@1"]["chain"] == 1.0
    assert record["routes"]["chain"]["n"] == len(SUMS)
    for line in lines:
        has_point = line["step"] in (2, STEPS)
        assert ("eval/pass@1/chain" in line) == has_point, line
        if has_point:
            point = next(p for p in record["points"] if p["step"] == line["step"])
            assert line["eval/pass@1/chain"] == point["pass@1"]["chain"]
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["data"]["sources"][0]["reward"] == "math"
