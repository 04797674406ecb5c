"""MOPD loss: hand-computed cases per correction, clip and normalizer; properties; μ immutability;
GRPO; composition; teacher targets; the top-k estimator."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mopd_hpc.config.loss import LossConfig
from mopd_hpc.mopd.compose import CompositionError, compose_advantages, compose_loss
from mopd_hpc.mopd.grpo import grpo_advantages, grpo_policy_loss
from mopd_hpc.mopd.loss import importance_weights, mopd_loss
from mopd_hpc.mopd.normalize import LossInputError
from mopd_hpc.mopd.targets import TargetError, aggregate_teacher_targets
from mopd_hpc.mopd.topk import TeacherTopK, topk_reverse_kl_loss

F64 = torch.float64
LN = math.log


def t(rows: list[list[float]], grad: bool = False) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64, requires_grad=grad)


def run(lp, mu, s, w, mask, config, **kw):
    lp = t(lp, grad=True)
    loss, stats = mopd_loss(lp, t(mu), t(s), t(w), torch.tensor(mask, dtype=torch.bool), config, **kw)
    loss.backward()
    return loss.item(), lp.grad, stats


# --------------------------------------------------------------------------- hand-computed cases
# Two tokens, π_θ = (0.5, 0.9); μ = (0.05, 0.9) → r = (10, 1). One teacher, w = 1, π_T = (0.25, 0.6).
LP = [[LN(0.5), LN(0.9)]]
MU = [[LN(0.05), LN(0.9)]]
S = [[LN(0.25), LN(0.6)]]
W = [[1.0, 1.0]]
A = [LN(0.25) - LN(0.5), LN(0.6) - LN(0.9)]  # A_t = S − W·log π_θ


def test_truncate_caps_ratio_and_keeps_gradient_at_the_cap() -> None:
    loss, grad, stats = run(LP, MU, S, W, [[True, True]], LossConfig(correction="truncate", ratio_cap=5.0))
    rho = [5.0, 1.0]
    want = -(rho[0] * A[0] * LN(0.5) + rho[1] * A[1] * LN(0.9)) / 2
    assert loss == pytest.approx(want, abs=1e-12)
    assert grad[0].tolist() == pytest.approx([-rho[0] * A[0] / 2, -rho[1] * A[1] / 2], abs=1e-12)
    assert grad[0, 0] != 0  # truncation, not PPO clipping: the capped token still has a gradient
    assert stats["mopd/ratio_capped_frac"].item() == pytest.approx(0.5)
    assert stats["mopd/rho_mean"].item() == pytest.approx(3.0)
    assert stats["mopd/ratio_masked_frac"].item() == 0


def test_mask_drops_tokens_outside_bounds_but_keeps_them_in_the_normalizer() -> None:
    lp = [[LN(0.5), LN(0.9), LN(0.1)]]
    mu = [[LN(0.05), LN(0.9), LN(0.5)]]  # r = 10, 1, 0.2
    s = [[LN(0.25), LN(0.6), LN(0.3)]]
    config = LossConfig(correction="mask", mask_low=0.5, mask_high=2.0)
    loss, grad, stats = run(lp, mu, s, [[1.0] * 3], [[True] * 3], config)
    a1 = LN(0.6) - LN(0.9)
    assert loss == pytest.approx(-(a1 * LN(0.9)) / 3, abs=1e-12)  # divided by 3, not by 1 kept token
    assert grad[0].tolist() == pytest.approx([0.0, -a1 / 3, 0.0], abs=1e-12)
    assert stats["mopd/ratio_masked_frac"].item() == pytest.approx(2 / 3)
    assert stats["mopd/rho_mean"].item() == pytest.approx(1 / 3)


def test_none_uses_unit_ratio() -> None:
    loss, grad, stats = run(LP, MU, S, W, [[True, True]], LossConfig(correction="none"))
    assert loss == pytest.approx(-(A[0] * LN(0.5) + A[1] * LN(0.9)) / 2, abs=1e-12)
    assert grad[0].tolist() == pytest.approx([-A[0] / 2, -A[1] / 2], abs=1e-12)
    assert stats["mopd/rho_mean"].item() == 1.0
    assert stats["mopd/reverse_kl"].item() == pytest.approx(-(A[0] + A[1]) / 2, rel=1e-6)
    assert stats["mopd/teacher_student_gap"].item() == pytest.approx((A[0] + A[1]) / 2, rel=1e-6)


def test_advantage_clip() -> None:
    lp = [[LN(0.5), LN(0.5)]]
    s = [[LN(0.5) + 7.0, LN(0.5) - 0.5]]  # A = +7 (clipped to 5), −0.5
    config = LossConfig(correction="none", advantage_clip=5.0)
    loss, grad, stats = run(lp, lp, s, [[1.0, 1.0]], [[True, True]], config)
    assert loss == pytest.approx(-(5.0 * LN(0.5) - 0.5 * LN(0.5)) / 2, abs=1e-12)
    assert grad[0].tolist() == pytest.approx([-5.0 / 2, 0.5 / 2], abs=1e-12)
    assert stats["mopd/advantage_clipped_frac"].item() == pytest.approx(0.5)


def test_normalizers_on_sequences_of_different_length() -> None:
    # Sequence 0 has one loss token, sequence 1 has three; ρ = 1, W = 1, per-token loss ℓ = −A·lp.
    lp = [[LN(0.5), 0.0, 0.0], [LN(0.4), LN(0.2), LN(0.8)]]
    s = [[LN(0.3), 0.0, 0.0], [LN(0.1), LN(0.7), LN(0.2)]]
    mask = [[True, False, False], [True, True, True]]
    ell = [[-(s[b][i] - lp[b][i]) * lp[b][i] for i in range(3)] for b in range(2)]
    config = LossConfig(correction="none", normalizer="token-mean")
    loss, grad, _ = run(lp, lp, s, [[1.0] * 3] * 2, mask, config)
    assert loss == pytest.approx((ell[0][0] + sum(ell[1])) / 4, abs=1e-12)
    assert grad[0, 0].item() == pytest.approx(-(s[0][0] - lp[0][0]) / 4, abs=1e-12)
    config = LossConfig(correction="none", normalizer="seq-mean-token-mean")
    loss, grad, _ = run(lp, lp, s, [[1.0] * 3] * 2, mask, config)
    assert loss == pytest.approx((ell[0][0] / 1 + sum(ell[1]) / 3) / 2, abs=1e-12)
    assert grad[0, 0].item() == pytest.approx(-(s[0][0] - lp[0][0]) / 2, abs=1e-12)
    assert grad[1, 2].item() == pytest.approx(-(s[1][2] - lp[1][2]) / 6, abs=1e-12)


def test_orm_alpha_adds_the_sequence_advantage() -> None:
    config = LossConfig(correction="none", orm_alpha=0.5)
    orm = torch.tensor([2.0], dtype=F64)
    loss, grad, _ = run(LP, LP, S, W, [[True, True]], config, orm_advantages=orm)
    a = [A[0] + 1.0, A[1] + 1.0]
    assert loss == pytest.approx(-(a[0] * LN(0.5) + a[1] * LN(0.9)) / 2, abs=1e-12)
    with pytest.raises(LossInputError, match="orm_advantages is None"):
        run(LP, LP, S, W, [[True, True]], config)


# --------------------------------------------------------------------------- μ is never touched
def test_behavior_logprobs_cannot_be_overwritten_or_replaced() -> None:
    lp = torch.randn(3, 4, requires_grad=True)
    mu = torch.randn(3, 4)
    snapshot, version = mu.clone(), mu._version
    loss, stats = mopd_loss(lp, mu, torch.randn(3, 4), torch.ones(3, 4), torch.ones(3, 4), LossConfig())
    loss.backward()
    for value in [loss, *stats.values()]:  # in-place changes of every returned value cannot reach μ
        value.data.add_(100.0)
    assert mu._version == version
    assert torch.equal(mu, snapshot)
    with pytest.raises(LossInputError, match="requires grad"):
        mopd_loss(lp, mu.clone().requires_grad_(True), mu, mu, torch.ones(3, 4), LossConfig())
    with pytest.raises(LossInputError, match="shares storage with logprobs"):  # a proximal log-prob as μ
        mopd_loss(lp, lp.detach(), mu, mu, torch.ones(3, 4), LossConfig())


def test_shape_and_estimator_errors_name_the_field() -> None:
    lp = torch.randn(2, 3, requires_grad=True)
    with pytest.raises(LossInputError, match="teacher_weight_sum has shape"):
        mopd_loss(lp, torch.randn(2, 3), torch.randn(2, 3), torch.ones(2, 4), torch.ones(2, 3), LossConfig())
    with pytest.raises(LossInputError, match="topk_reverse_kl_loss"):
        mopd_loss(
            lp,
            torch.randn(2, 3),
            lp.detach() + 1,
            torch.ones(2, 3),
            torch.ones(2, 3),
            LossConfig(estimator="topk"),
        )
    with pytest.raises(LossInputError, match="values other than 0 and 1"):
        mopd_loss(
            lp, torch.randn(2, 3), torch.randn(2, 3), torch.ones(2, 3), torch.full((2, 3), 2), LossConfig()
        )


# --------------------------------------------------------------------------- properties
CONFIGS = st.sampled_from(
    [
        LossConfig(),
        LossConfig(correction="mask", mask_low=0.5, mask_high=2.0, normalizer="seq-mean-token-mean"),
        LossConfig(correction="none", advantage_clip=1.0),
    ]
)


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 4),
    length=st.integers(1, 6),
    seed=st.integers(0, 2**31),
    config=CONFIGS,
    junk=st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30, -3.0]),
)
def test_masked_tokens_never_change_loss_or_gradient(b, length, seed, config, junk) -> None:
    gen = torch.Generator().manual_seed(seed)
    shape = (b, length)
    mask = torch.rand(shape, generator=gen) < 0.6
    base = [-torch.rand(shape, generator=gen, dtype=F64) * 3 for _ in range(3)]
    weight = torch.rand(shape, generator=gen, dtype=F64) + 0.1

    def loss_and_grad(fill: float | None):
        def f(x):
            return x if fill is None else torch.where(mask, x, torch.full_like(x, fill))

        lp = f(base[0]).clone().requires_grad_(True)
        loss, _ = mopd_loss(lp, f(base[1]), f(base[2]), f(weight), mask, config)
        loss.backward()
        return loss.detach(), lp.grad

    loss0, grad0 = loss_and_grad(None)
    loss1, grad1 = loss_and_grad(junk)
    assert torch.equal(loss0, loss1)
    assert torch.equal(grad0, grad1)
    assert torch.all(grad1[~mask] == 0)


@settings(max_examples=60, deadline=None)
@given(
    log_ratio=st.lists(st.floats(-50, 50, allow_nan=False), min_size=1, max_size=16),
    cap=st.floats(1.0, 20.0),
)
def test_truncated_ratio_never_exceeds_cap_and_capped_tokens_keep_gradient(log_ratio, cap) -> None:
    lr = torch.tensor([log_ratio], dtype=F64)
    mask = torch.ones_like(lr, dtype=torch.bool)
    config = LossConfig(correction="truncate", ratio_cap=cap)
    rho, capped, _ = importance_weights(lr, mask, config)
    assert torch.all(rho <= cap * (1 + 1e-12))
    assert torch.equal(capped, lr > math.log(cap))
    # Through the loss: a capped token's gradient is −C·A/N, never 0 (A = −1 here).
    lp = torch.full_like(lr, -1.0).requires_grad_(True)
    mu = lp.detach() - lr
    loss, _ = mopd_loss(lp, mu, lp.detach() - 1.0, torch.ones_like(lr), mask, config)
    loss.backward()
    n = lr.numel()
    assert torch.allclose(lp.grad, rho / n, rtol=1e-10, atol=0)
    assert torch.all(lp.grad[capped] > 0)


# --------------------------------------------------------------------------- GRPO and composition
def test_grpo_advantages_are_group_normalized() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    adv = grpo_advantages(rewards, group_size=3)
    m, sd = 1 / 3, math.sqrt(2 / 9)
    want = [(1 - m) / (sd + 1e-6), -m / (sd + 1e-6), -m / (sd + 1e-6), 0.0, 0.0, 0.0]
    assert adv.tolist() == pytest.approx(want, rel=1e-6, abs=1e-7)
    assert grpo_advantages(rewards, group_size=3, scale_by_std=False).tolist() == pytest.approx(
        [2 / 3, -1 / 3, -1 / 3, 0, 0, 0], abs=1e-7
    )
    with pytest.raises(LossInputError, match="group_size is 4"):
        grpo_advantages(rewards, group_size=4)


def test_grpo_policy_loss_clips_like_ppo() -> None:
    lp = t([[LN(0.6), LN(0.3)]], grad=True)
    old = t([[LN(0.4), LN(0.3)]])  # ratio 1.5 (clipped to 1.2 for A > 0), 1.0
    config = LossConfig(rl_coefficient=1.0, distillation_coefficient=0.0, ppo_clip=0.2)
    loss, stats = grpo_policy_loss(lp, old, torch.tensor([2.0], dtype=F64), torch.ones(1, 2), config)
    loss.backward()
    assert loss.item() == pytest.approx(-(1.2 * 2.0 + 1.0 * 2.0) / 2, abs=1e-12)
    assert lp.grad[0].tolist() == pytest.approx([0.0, -2.0 / 2], abs=1e-12)  # clipped token: no grad
    assert stats["grpo/clipped_frac"].item() == pytest.approx(0.5)


def test_grpo_kl_penalty_needs_reference() -> None:
    config = LossConfig(rl_coefficient=1.0, kl_coefficient=0.1)
    lp = torch.zeros(1, 2, requires_grad=True)
    with pytest.raises(LossInputError, match="ref_logprobs is None"):
        grpo_policy_loss(lp, torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), config)
    ref = torch.full((1, 2), -1.0)
    loss, stats = grpo_policy_loss(
        lp, torch.zeros(1, 2), torch.zeros(1), torch.ones(1, 2), config, ref_logprobs=ref
    )
    k3 = math.exp(-1) + 1 - 1
    assert stats["grpo/kl_ref"].item() == pytest.approx(k3, rel=1e-6)
    assert loss.item() == pytest.approx(0.1 * k3, rel=1e-6)


def test_zero_coefficient_skips_its_term_even_if_nan() -> None:
    calls = []

    def teacher_term() -> torch.Tensor:
        calls.append(1)
        return torch.tensor(float("nan"))

    rl = torch.tensor(0.75)
    rl_only = LossConfig(rl_coefficient=1.0, distillation_coefficient=0.0)
    assert torch.equal(compose_loss(rl_only, rl=rl, distill=teacher_term), rl)
    assert calls == []  # c_d = 0: the distillation term (and its teacher call) never runs
    distill_only = LossConfig(rl_coefficient=0.0, distillation_coefficient=2.0)
    assert compose_loss(distill_only, rl=torch.tensor(float("nan")), distill=torch.tensor(0.25)).item() == 0.5
    both = LossConfig(rl_coefficient=0.5, distillation_coefficient=2.0)
    assert compose_loss(both, rl=rl, distill=lambda: torch.tensor(0.25)).item() == pytest.approx(0.875)
    with pytest.raises(CompositionError, match="distillation_coefficient is 2.0 but its loss term is None"):
        compose_loss(both, rl=rl, distill=None)


@settings(max_examples=40, deadline=None)
@given(
    rl_value=st.floats(-1e6, 1e6, allow_nan=False),
    c_rl=st.floats(1e-3, 10.0),
    distill=st.sampled_from([float("nan"), float("inf"), 1.0]),
)
def test_zero_distillation_is_exactly_the_rl_loss(rl_value, c_rl, distill) -> None:
    config = LossConfig(distillation_coefficient=0.0, rl_coefficient=c_rl)
    calls = []

    def teacher_term() -> torch.Tensor:
        calls.append(1)
        return torch.tensor(distill)

    rl = torch.tensor(rl_value, dtype=F64)
    assert torch.equal(compose_loss(config, rl=rl, distill=teacher_term), c_rl * rl)
    assert calls == []


def test_compose_advantages_broadcasts_sequence_advantage() -> None:
    tok = torch.zeros(2, 3)
    out = compose_advantages(tok, torch.tensor([1.0, -2.0]), alpha=0.5)
    assert out.tolist() == [[0.5] * 3, [-1.0] * 3]
    assert compose_advantages(tok, torch.full((9,), float("nan")), alpha=0.0) is tok
    with pytest.raises(CompositionError, match="orm_advantages has shape"):
        compose_advantages(tok, torch.ones(3), alpha=1.0)


# --------------------------------------------------------------------------- targets
def test_targets_weighted_sum_float32_and_ignores_unscored_rows() -> None:
    a = torch.tensor([[-1.0, -2.0], [float("nan"), float("nan")]], dtype=torch.bfloat16)
    b = torch.tensor([[-0.5, -0.25], [-3.0, -4.0]], dtype=torch.float16)
    out = aggregate_teacher_targets({"a": a, "b": b}, [{"a": 2.0, "b": 0.5}, {"a": 0.0, "b": 3.0}])
    assert out.logp_sum.dtype == torch.float32 and out.weight_sum.dtype == torch.float32
    assert out.logp_sum.tolist() == [[-2.25, -4.125], [-9.0, -12.0]]
    assert out.weight_sum.tolist() == [[2.5, 2.5], [3.0, 3.0]]


def test_targets_errors() -> None:
    lp = torch.zeros(1, 2)
    with pytest.raises(TargetError, match="all 0"):
        aggregate_teacher_targets({"a": lp}, [{"a": 0.0}])
    with pytest.raises(TargetError, match="weight of teacher 'a' is -1"):
        aggregate_teacher_targets({"a": lp}, [{"a": -1.0}])
    with pytest.raises(TargetError, match="teacher 'b' weight 1.0 but teacher_logprobs has only"):
        aggregate_teacher_targets({"a": lp}, [{"b": 1.0}])
    with pytest.raises(TargetError, match="expected B = 1"):
        aggregate_teacher_targets({"a": lp}, [{"a": 1.0}, {"a": 1.0}])


# --------------------------------------------------------------------------- top-k estimator
def test_topk_with_k_at_least_vocab_is_the_exact_reverse_kl() -> None:
    gen = torch.Generator().manual_seed(0)
    b, length, vocab = 2, 3, 7
    student = torch.randn(b, length, vocab, generator=gen, dtype=F64, requires_grad=True)
    teachers = {tid: torch.randn(b, length, vocab, generator=gen, dtype=F64) for tid in ("a", "b")}
    weights = {"a": torch.tensor([1.0, 0.0], dtype=F64), "b": torch.tensor([0.5, 2.0], dtype=F64)}
    mask = torch.tensor([[True, True, False], [True, True, True]])
    topk = {tid: TeacherTopK.from_logits(x, k=vocab + 5) for tid, x in teachers.items()}
    loss, stats = topk_reverse_kl_loss(student, topk, weights, mask, LossConfig(estimator="topk"))
    (grad,) = torch.autograd.grad(loss, student)

    p = torch.log_softmax(student, -1)
    exact = sum(
        weights[tid][:, None] * (p.exp() * (p - torch.log_softmax(x, -1))).sum(-1)
        for tid, x in teachers.items()
    )
    want = torch.where(mask, exact, 0.0).sum() / mask.sum()
    (want_grad,) = torch.autograd.grad(want, student)
    torch.testing.assert_close(loss, want, atol=1e-12, rtol=0)
    torch.testing.assert_close(grad, want_grad, atol=1e-12, rtol=0)
    assert stats["topk/teacher_mass"].item() == pytest.approx(1.0, abs=1e-6)


def test_topk_truncated_is_zero_when_student_matches_teacher_on_topk() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 2, 50, generator=gen, dtype=F64, requires_grad=True)
    top = TeacherTopK.from_logits(logits.detach(), k=8)
    loss, _ = topk_reverse_kl_loss(
        logits, {"a": top}, {"a": torch.ones(1, dtype=F64)}, torch.ones(1, 2), LossConfig(estimator="topk")
    )
    (grad,) = torch.autograd.grad(loss, logits)
    assert abs(loss.item()) < 1e-12  # p = q on the top-k set is the stationary point
    assert grad.abs().max().item() < 1e-12
