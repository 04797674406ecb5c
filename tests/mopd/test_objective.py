"""The one objective (`mopd.objective.Objective`): float64 enumeration oracles of the composed loss, the
refusals, and the torch engine's loss against an exact float64 reverse KL.

Enumeration (the tabular policy of tests/mopd/test_mopd_oracle.py: every sequence y ∈ V^T weighted by its exact
probability, on-policy μ = π_θ, token-mean over T tokens; 1e-10):

    E_y ∇[c_d·L_MOPD(y) + c_rl·L_GRPO(y)]
        = c_d·(∇ Σ_t E_{s_t~sg(π_θ)} Σ_j w_j·KL(π_θ ‖ π_j)/T − α·∇ E_{y~π_θ}[A(y)]/T) − c_rl·∇ E_{y~π_θ}[A(y)]/T

with A(y) a fixed per-sequence advantage (the score-function identity Σ_y P_θ(y)·A(y)·∇log P_θ(y) =
∇ Σ_y P_θ(y)·A(y); on-policy, PPO's ratio is 1 and its clip inactive; MiMo eq. 9 puts α·A into the
distillation advantage). The top-k estimator with k = V is the exact per-position reverse KL, so its expected
gradient is the first term alone (MOPD paper's top-k variant).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from helpers_models import save_micro_qwen3
from test_mopd_oracle import F64, TOL, Tabular, exact_reverse_kl_grad

from mopd_hpc.config.loss import LossConfig
from mopd_hpc.config.models import OptimizerConfig
from mopd_hpc.engines.batch import TokenBatch, TrainBatch
from mopd_hpc.engines.protocol import EngineError
from mopd_hpc.engines.torch.engine import TorchTrainEngine
from mopd_hpc.mopd.objective import Objective, ObjectiveError
from mopd_hpc.mopd.targets import TeacherTargets
from mopd_hpc.mopd.topk import TeacherTopK


def advantage(y: tuple[int, ...]) -> float:
    """A fixed per-sequence advantage (a stand-in for a GRPO advantage of the sequence's reward)."""
    return float(sum((i + 1) * v for i, v in enumerate(y)) % 5) - 2.0


def enumerate_objective(student: Tabular, teachers: dict[str, Tabular], weights, config: LossConfig):
    """Σ_y P(y)·∇L(y) with L = `Objective(config)` on each sequence y (its log-probs, S/W, top-k with k = V)."""
    theta = student.logits.clone().requires_grad_(True)
    table = student.logp_table(theta)
    tables = {tid: t.logp_table() for tid, t in teachers.items()}
    objective = Objective(config)
    total = torch.zeros((), dtype=F64)
    mask = torch.ones(1, student.length, dtype=torch.bool)
    for y in itertools.product(range(student.vocab), repeat=student.length):
        lp = student.sequence_logprobs(y, table)[None]
        mu = lp.detach().clone()
        rows = [student.row[y[:t]] for t in range(student.length)]
        s = sum(w * student.sequence_logprobs(y, tables[tid])[None] for tid, w in weights.items())
        targets = TeacherTargets(s, torch.full_like(lp, float(sum(weights.values()))))
        topk = {
            tid: TeacherTopK.from_logits(teachers[tid].logits[rows][None], student.vocab) for tid in weights
        }
        w = {tid: torch.tensor([wt], dtype=F64) for tid, wt in weights.items()}
        loss, _ = objective(
            logprobs=lp, behavior_logprobs=mu, loss_mask=mask, targets=targets, teacher_topk=topk,
            teacher_weights=w, student_logprobs=lambda ids, rows=rows: table[rows][None].gather(-1, ids),
            orm_advantages=torch.tensor([advantage(y)], dtype=F64),
        )  # fmt: skip
        total = total + torch.exp(mu.sum()) * loss
    (grad,) = torch.autograd.grad(total, theta)
    return grad


def expected_advantage_grad(student: Tabular) -> torch.Tensor:
    """∇ E_{y~π_θ}[A(y)] / T, exactly."""
    theta = student.logits.clone().requires_grad_(True)
    table = student.logp_table(theta)
    value = sum(
        torch.exp(student.sequence_logprobs(y, table).sum()) * advantage(y)
        for y in itertools.product(range(student.vocab), repeat=student.length)
    )
    (grad,) = torch.autograd.grad(value / student.length, theta)
    return grad


@pytest.mark.parametrize(
    "fields",
    [
        {"estimator": "sampled", "correction": "truncate"},
        {"estimator": "sampled", "correction": "none", "rl_coefficient": 0.7},
        {"estimator": "sampled", "correction": "mask", "orm_alpha": 0.4},
        {"estimator": "sampled", "correction": "truncate", "rl_coefficient": 0.3, "orm_alpha": 0.6},
        {"estimator": "sampled", "distillation_coefficient": 0.0, "rl_coefficient": 1.0},
        {"estimator": "topk", "topk": 64},
        {"estimator": "topk", "topk": 64, "rl_coefficient": 0.5, "distillation_coefficient": 2.0},
    ],
    ids=["sampled", "sampled_rl", "sampled_alpha", "sampled_rl_alpha", "rl_only", "topk", "topk_rl"],
)
def test_composed_objective_equals_the_enumeration_oracle(fields: dict) -> None:
    config = LossConfig(**fields)
    weights = {"a": 0.6, "b": 1.3}
    student = Tabular(3, 3, seed=21)
    teachers = {"a": Tabular(3, 3, seed=22), "b": Tabular(3, 3, seed=23)}
    got = enumerate_objective(student, teachers, weights, config)
    kl_grad, _ = exact_reverse_kl_grad(student, teachers, weights)
    adv_grad = expected_advantage_grad(student)
    c_d, c_rl, alpha = config.distillation_coefficient, config.rl_coefficient, config.orm_alpha
    want = c_d * (kl_grad - alpha * adv_grad) - c_rl * adv_grad
    assert float(want.abs().max()) > 1e-3
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)


def test_objective_refuses_what_no_engine_applies_and_names_missing_inputs() -> None:
    built = LossConfig()
    for update, field in (({"orm_alpha": 0.5}, "orm_alpha"), ({"correction": "truncate"}, "correction")):
        cfg = built.model_copy(update={"estimator": "topk", "correction": "none", **update})
        with pytest.raises(ObjectiveError, match=f"loss.{field}"):
            Objective(cfg)
    lp = torch.zeros(1, 2, requires_grad=True)
    common = {
        "logprobs": lp,
        "behavior_logprobs": torch.zeros(1, 2),
        "loss_mask": torch.ones(1, 2, dtype=torch.bool),
    }
    with pytest.raises(ObjectiveError, match="needs batch.targets"):
        Objective(LossConfig())(**common)
    with pytest.raises(ObjectiveError, match="needs batch.teacher_topk"):
        Objective(LossConfig(estimator="topk"))(**common)
    with pytest.raises(ObjectiveError, match="needs batch.orm_advantages"):
        Objective(LossConfig(distillation_coefficient=0.0, rl_coefficient=1.0))(**common)
    # the config refuses them first (what --check runs), naming both fields
    with pytest.raises(ValueError, match=r"loss.correction 'mask' has no effect with loss.estimator 'topk'"):
        LossConfig(estimator="topk", correction="mask")
    assert LossConfig(estimator="topk").correction == "none" and LossConfig().correction == "truncate"
    assert LossConfig(**LossConfig(estimator="topk").model_dump()).correction == "none"  # resolved reloads


def test_torch_engine_topk_loss_is_the_exact_reverse_kl_in_float64(tmp_path: Path) -> None:
    """k = V: the torch engine's loss (+ c_rl·GRPO) equals Σ_t Σ_j w_j·KL(p‖q_j)/N from full float64 softmaxes."""
    vocab = 16
    student = save_micro_qwen3(tmp_path / "s", 0, vocab_size=vocab, initializer_range=0.3)
    config = LossConfig(estimator="topk", topk=vocab, rl_coefficient=0.25)
    from mopd_hpc.engines.torch.hf_model import load_causal_lm

    model = load_causal_lm(student, "float32", torch.device("cpu")).double()
    engine = TorchTrainEngine(model, str(student), torch.device("cpu"), OptimizerConfig(lr=1e-3), config)
    tokens = TokenBatch.from_samples([[1, 2, 3], [4, 5]], [[6, 7, 8, 9], [10, 11]], pad_id=0)
    g = torch.Generator().manual_seed(0)
    mask = tokens.response_mask
    teacher_logits = {
        t: 2 * torch.randn(2, tokens.response_width, vocab, generator=g, dtype=F64) for t in "ab"
    }
    weights = {"a": torch.tensor([1.0, 0.3], dtype=F64), "b": torch.tensor([0.0, 0.7], dtype=F64)}
    top = {t: TeacherTopK.from_logits(x, vocab) for t, x in teacher_logits.items()}
    adv = torch.tensor([0.8, -1.1], dtype=F64)
    with torch.no_grad():
        full = torch.log_softmax(model(input_ids=tokens.input_ids).logits, -1)
        p = full.gather(1, tokens.logit_positions[..., None].expand(-1, -1, vocab))
    lp_sampled = p.gather(-1, tokens.response_ids[..., None]).squeeze(-1)
    behavior = torch.where(mask, lp_sampled - 0.1, 0.0).float()
    batch = TrainBatch.create(
        tokens, behavior, teacher_topk=top, teacher_weights=weights, orm_advantages=adv.float()
    )
    loss, _, _ = engine.compute_loss(batch)
    kl = sum(
        weights[t][:, None] * (p.exp() * (p - torch.log_softmax(x, -1))).sum(-1)
        for t, x in teacher_logits.items()
    )
    ratio = torch.exp(lp_sampled - behavior.double())
    grpo = -torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.2) * adv[:, None])
    n = mask.sum()
    want = (kl * mask).sum() / n + 0.25 * (grpo * mask).sum() / n
    assert abs(float(loss.detach()) - float(want)) <= 1e-10, (float(loss.detach()), float(want))
    bad = LossConfig().model_copy(update={"estimator": "topk", "correction": "mask"})
    with pytest.raises(EngineError, match="loss.correction='mask'"):
        TorchTrainEngine(model, str(student), torch.device("cpu"), OptimizerConfig(lr=1e-3), bad)
