"""`loss.sft_warmup_steps` / `loss.sft_warmup_ratio`: the SFT-then-MOPD recipe (trainer/sft_warmup.py, mopd/sft.py).

Checks, on micro models with the real servers (the controller in-process, as tests/trainer/test_controller.py):
- warm-up 0 (steps 0, or ratio 0) is today's run: the same three steps' losses, bitwise, as a config without
  the field, and the same final weights;
- a warm-up ratio r is the run of sft_warmup_steps = round(r·steps): the same losses, bitwise;
- the warm-up steps are SFT steps: step 1's loss equals the cross-entropy of the start student on the route
  teachers' greedy answers to step 1's prompts (recomputed here: the teachers generating in this process,
  the student's HF forward), the steps after the warm-up are MOPD steps;
and the loss and the config's refusals without servers.

A run of one set of changes is run once for the module (`sft_run`: the warm-up-steps test and the ratio test
share the run of sft_warmup_steps 2; each run starts three servers, ~17 CPU-s of imports).
"""

from __future__ import annotations

import pytest
import torch
import yaml
from helpers_configs import set_dotted, without_sft_warmup
from safetensors.torch import load_file
from test_controller import REPO, micro_config, run_controller

from mopd_hpc.config import ConfigError, RunConfig
from mopd_hpc.config.loss import LossConfig
from mopd_hpc.mopd.objective import Objective
from mopd_hpc.records.metrics import read_metrics
from mopd_hpc.trainer.sft_warmup import cut_after_eos, route_teacher


def _losses(run_dir):
    return [(line["step"], line["loss/total"]) for line in read_metrics(run_dir / "metrics.jsonl")]


def _final_weights(run_dir):
    return load_file(str(run_dir / "student_final" / "model.safetensors"))


@pytest.fixture(scope="module")
def sft_run(micro_models, tmp_path_factory):
    """`sft_run(name, **changes)`: (config, run_dir, outcome, exit codes, stdout) of `run_controller` on the micro
    config with the top-k estimator and `changes` (dotted keys), run once per name for the module."""
    runs, asked = {}, {}

    def run(name: str, **changes: object):
        assert asked.setdefault(name, changes) == changes, (name, asked[name], changes)  # one run, one name
        if name not in runs:
            tmp_path = tmp_path_factory.mktemp(name)
            run_dir = tmp_path / "run"
            config = micro_config(
                micro_models, run_dir, tmp_path / "c.yaml", **{"loss.estimator": "topk", **changes}
            )
            runs[name] = (config, run_dir, *run_controller(config, run_dir, f"job-{name}")[1:])
        return runs[name]

    return run


def test_zero_warmup_is_todays_run(sft_run):
    runs = {}
    cases = (
        ("today", {}),
        ("zero", {"loss.sft_warmup_steps": 0}),
        ("ratio0", {"loss.sft_warmup_ratio": 0.0}),
    )
    for name, changes in cases:
        _, run_dir, outcome, codes, out = sft_run(name, **changes)
        assert (outcome.reason, outcome.step) == ("finished", 3) and codes == [0, 0, 0], out
        runs[name] = run_dir
    today = _final_weights(runs["today"])
    for name in ("zero", "ratio0"):
        assert _losses(runs[name]) == _losses(runs["today"])  # bitwise: float equality of every step
        assert all("loss/sft" not in line for line in read_metrics(runs[name] / "metrics.jsonl"))
        weights = _final_weights(runs[name])
        assert today.keys() == weights.keys() and all(torch.equal(today[k], weights[k]) for k in today)


def test_warmup_ratio_is_its_steps(sft_run):
    """Ratio 0.6 of 3 steps is round(1.8) = 2 SFT steps: the run of sft_warmup_steps 2, loss for loss."""
    runs = {}
    for name, changes in (("steps", {"loss.sft_warmup_steps": 2}), ("ratio", {"loss.sft_warmup_ratio": 0.6})):
        config, run_dir, outcome, codes, out = sft_run(name, **changes)
        assert RunConfig.from_yaml(config).steps == 3
        assert (outcome.reason, outcome.step) == ("finished", 3) and codes == [0, 0, 0], out
        runs[name] = read_metrics(run_dir / "metrics.jsonl")
    assert [("loss/sft" in line) for line in runs["ratio"]] == [True, True, False]
    assert [(x["step"], x["loss/total"]) for x in runs["ratio"]] == [
        (x["step"], x["loss/total"]) for x in runs["steps"]
    ]  # bitwise


@pytest.mark.parametrize(("ratio", "steps", "want"), [(0.0, 2500, 0), (0.04, 2500, 100), (0.6, 3, 2), (0.5, 3, 2),
                                                      (0.1, 3, 0), (1.0, 7, 7)])  # fmt: skip
def test_warmup_ratio_steps_are_rounded(ratio, steps, want):
    """round(ratio·steps), Python's round (as optimizer.warmup_ratio): 1.5 → 2, 0.3 → 0."""
    loss = LossConfig(estimator="topk", sft_warmup_ratio=ratio)
    assert loss.sft_steps(steps) == want == round(ratio * steps)
    assert LossConfig(estimator="topk", sft_warmup_steps=want).sft_steps(None) == want
    with pytest.raises(ValueError, match="needs the run's steps"):
        loss.sft_steps(None)


def _reference_sft_loss(cfg: RunConfig) -> float:
    """Step 1's SFT loss recomputed: the stream's first batch, each prompt answered greedily by its route
    teacher in this process (the same `greedy_ids` the teacher server runs), the start student's token-mean
    cross-entropy on the answers from its HF forward."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mopd_hpc.engines.teacher.greedy_generate import GreedyRequest, greedy_ids
    from mopd_hpc.engines.torch.scoring import TorchScoringEngine
    from mopd_hpc.trainer.data_setup import build_run_data
    from mopd_hpc.trainer.rollout_phase import encode_prompts

    tok = AutoTokenizer.from_pretrained(cfg.models.tokenizer.path)
    draws = build_run_data(cfg).dataset.take(cfg.data.batch_size)
    prompts = encode_prompts(tok, draws, cfg.data.max_prompt_tokens)
    answers: dict[int, list[int]] = {}
    for teacher in cfg.models.teachers:
        rows = [i for i, d in enumerate(draws) if route_teacher(cfg.routes[d.route]) == teacher.id]
        engine = TorchScoringEngine.from_pretrained(teacher.path)
        request = GreedyRequest(
            tuple(tuple(prompts[i]) for i in rows),
            cfg.rollout.sampling.max_new_tokens,
            tok.eos_token_id,
            tok.pad_token_id,
        )
        for i, row in zip(rows, greedy_ids(engine, request), strict=True):
            answers[i] = cut_after_eos(row, tok.eos_token_id)
    student = AutoModelForCausalLM.from_pretrained(cfg.models.actor.path, torch_dtype=torch.float32)
    nll, count = 0.0, 0
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            ids = torch.tensor([prompt + answers[i]])
            logp = torch.log_softmax(student(input_ids=ids).logits[0].double(), dim=-1)
            for t, token in enumerate(answers[i]):
                nll -= float(logp[len(prompt) - 1 + t, token])
                count += 1
    return nll / count


def test_warmup_steps_are_sft_steps(sft_run):
    # the ratio test's run
    config, run_dir, outcome, codes, out = sft_run("steps", **{"loss.sft_warmup_steps": 2})
    assert (outcome.reason, outcome.step) == ("finished", 3) and codes == [0, 0, 0], out
    lines = read_metrics(run_dir / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2, 3]
    sft, mopd = lines[:2], lines[2]
    for line in sft:
        assert line["loss/sft"] == line["loss/total"] and line["loss/mopd"] == 0.0
        # its loss reads no teacher score: the teachers answered greedily but scored nothing (the refusal
        # count is present exactly when they score, records/metrics_schema.py)
        assert "mopd/teacher_refused_tokens" not in line
    assert mopd["mopd/teacher_refused_tokens"] == 0
    assert (
        "loss/sft" not in mopd
        and mopd["loss/mopd"] == mopd["loss/total"]
        and mopd["mopd/reverse_kl"] >= -1e-6
    )
    assert [line["rollout/weight_version"] for line in lines][2] == 2.0  # step 3 sampled by the student
    cfg = RunConfig.from_yaml(config)
    assert sft[0]["loss/sft"] == pytest.approx(_reference_sft_loss(cfg), rel=1e-5)


def test_sft_objective_is_the_token_mean_cross_entropy():
    logprobs = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.1, 0.7, 0.3]], dtype=torch.float64))
    logprobs.requires_grad_(True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    for normalizer, want in (
        ("token-mean", -(logprobs[mask]).sum() / 5),
        ("seq-mean-token-mean", -(logprobs[0, :2].mean() + logprobs[1].mean()) / 2),
    ):
        objective = Objective(LossConfig(estimator="topk", normalizer=normalizer, rl_coefficient=1.0))
        loss, stats = objective(
            logprobs=logprobs, behavior_logprobs=torch.zeros(2, 3), loss_mask=mask, sft=True
        )  # no teacher input and no A_ORM: the SFT step reads none
        assert float(loss.detach()) == pytest.approx(float(want), rel=1e-12) and set(stats) == {
            "sft/loss",
            "sft/tokens",
        }
        (grad,) = torch.autograd.grad(loss, logprobs)
        (want_grad,) = torch.autograd.grad(want, logprobs)
        assert torch.allclose(grad, want_grad)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"steps": 3, "loss.sft_warmup_steps": 4}, "loss.sft_warmup_steps"),
        ({"loss.sft_warmup_steps": 1, "loss.distillation_coefficient": 0.0, "loss.rl_coefficient": 1.0},
         "loss.sft_warmup_steps"),
        ({"loss.sft_warmup_ratio": 0.2, "loss.distillation_coefficient": 0.0, "loss.rl_coefficient": 1.0},
         "loss.sft_warmup_ratio"),
        ({"loss.sft_warmup_ratio": 0.2, "loss.sft_warmup_steps": 5}, "loss.sft_warmup_ratio"),
        ({"loss.sft_warmup_ratio": 1.5}, "loss.sft_warmup_ratio"),
    ],
)  # fmt: skip
def test_refused_warmups_name_the_field(changes, field):
    doc = without_sft_warmup(yaml.safe_load((REPO / "configs" / "local_cpu.yaml").read_text()))
    set_dotted(doc, changes)
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict(doc)
    assert field in str(err.value)
    if "loss.sft_warmup_steps" in changes and "loss.sft_warmup_ratio" in changes:
        assert "loss.sft_warmup_steps" in str(err.value)  # both fields named


@pytest.mark.parametrize(("steps", "want"), [(1, 0), (3, 2), (50, 25), (1500, 750)])
def test_a_warmup_ratio_scales_with_a_shorter_run(steps, want):
    """configs/local_cpu.yaml with a warm-up ratio 0.5 and `--set steps=N` (the tests', the README's smoke
    run): accepted, the warm-up round(0.5·N) steps (round(0.5) = 0, round(1.5) = 2), never longer than the
    run, where sft_warmup_steps 750 is refused at steps 3."""
    doc = yaml.safe_load((REPO / "configs" / "local_cpu.yaml").read_text())
    doc["loss"].pop("sft_warmup_steps", None)
    set_dotted(doc, {"steps": steps, "loss.sft_warmup_ratio": 0.5})
    cfg = RunConfig.from_dict(doc)
    assert cfg.loss.sft_steps(cfg.steps) == want <= steps
