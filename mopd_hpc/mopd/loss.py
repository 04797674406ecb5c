"""The MOPD surrogate loss on sampled tokens (the `sampled` estimator).

Per response token t (DESIGN.md §3; MiMo-V2-Flash report §4.4 eqs. 6-9; AReaL feature/mopd loss.py):

    A_t  = sg(S_t − W_t·log π_θ(y_t))                 distillation advantage, S and W from `targets`
    A_t ← clip(A_t, −A_max, A_max)                    optional (MOPD paper, A_max = 5)
    A_t ← A_t + α·A_ORM                               optional advantage-level composition (MiMo eq. 9)
    r_t  = π_θ(y_t) / μ(y_t)                          μ = behavior policy (rollout engine log-probs)
    ρ_t  = sg(min(r_t, C))                            correction "truncate" (AReaL, C = 5)
         = sg(r_t)·1[ε_low ≤ r_t ≤ ε_high]            correction "mask" (IcePop; MiMo eq. 8)
         = 1                                          correction "none"
    L    = −Σ_t m_t·ρ_t·A_t·log π_θ(y_t) / normalizer (see `normalize`)

With ρ = 1 the expected gradient is ∇ Σ_t E_{s_t~sg(π_θ)} Σ_j w_j·KL(π_θ(·|s_t) ‖ π_j(·|s_t)) / normalizer
(score-function estimator; tests/mopd/test_mopd_oracle.py checks it by enumeration to 1e-10). Truncation keeps
the gradient of capped tokens (ρ is a detached weight, not a PPO clip that zeroes it).

The behavior log-probs μ are read only: this module writes into no input, refuses a μ that requires
grad, and refuses a μ that shares storage with π_θ's log-probs (a recomputed proximal log-prob standing
in for μ would silently turn the correction off — the fault found in one AReaL review).

Shape legend: B sequences, T response positions. Every tensor argument is [B, T].
"""

from __future__ import annotations

import math

import torch

from mopd_hpc.config.loss import LossConfig
from mopd_hpc.mopd.compose import compose_advantages
from mopd_hpc.mopd.normalize import LossInputError, as_bool_mask, masked_mean, normalize

Stats = dict[str, torch.Tensor]


def check_behavior_logprobs(behavior_logprobs: torch.Tensor, logprobs: torch.Tensor) -> None:
    """Raise `LossInputError` unless μ is a constant tensor distinct from π_θ's log-probs.

    μ must not require grad and must not share storage with `logprobs` (the trainer's log-probs,
    or a detached copy of them: a proximal log-prob in μ's place makes r_t ≡ 1).
    """
    if behavior_logprobs.requires_grad:
        raise LossInputError(
            "behavior_logprobs requires grad; expected the rollout engine's log-probs μ(y_t), a constant "
            "kept unchanged from rollout to loss (never a recomputed log-prob of the trainer)"
        )
    if behavior_logprobs.untyped_storage().data_ptr() == logprobs.untyped_storage().data_ptr():
        raise LossInputError(
            "behavior_logprobs shares storage with logprobs; expected the rollout engine's μ(y_t), not the "
            "trainer's log-probs (that would make the importance ratio 1 and disable the correction)"
        )


def check_same_shape(**tensors: torch.Tensor) -> torch.Size:
    """Raise `LossInputError` unless every tensor is [B, T] with the same shape; return that shape."""
    (first_name, first), *rest = tensors.items()
    if first.dim() != 2:
        raise LossInputError(f"{first_name} has shape {list(first.shape)}; expected [B, T]")
    for name, t in rest:
        if t.shape != first.shape:
            raise LossInputError(
                f"{name} has shape {list(t.shape)}; expected {list(first.shape)} like {first_name}"
            )
    return first.shape


def importance_weights(
    log_ratio: torch.Tensor, mask: torch.Tensor, config: LossConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ρ_t from the detached log importance ratio log r_t = log π_θ(y_t) − log μ(y_t).

    Args:
        log_ratio: [B, T] detached float; 0 at masked positions.
        mask: [B, T] bool loss mask.
        config: `correction`, `ratio_cap` (C), `mask_low` (ε_low), `mask_high` (ε_high).

    Returns:
        (ρ [B, T] no grad, capped [B, T] bool: r_t > C under truncate, dropped [B, T] bool: r_t outside
        [ε_low, ε_high] under mask), all restricted to `mask`.
    """
    no = torch.zeros_like(mask)
    if config.correction == "none":
        return torch.ones_like(log_ratio), no, no
    if config.correction == "truncate":
        log_cap = math.log(config.ratio_cap)
        capped = (log_ratio > log_cap) & mask
        return torch.exp(log_ratio.clamp(max=log_cap)), capped, no
    if config.correction == "mask":
        ratio = torch.exp(log_ratio)
        keep = (ratio >= config.mask_low) & (ratio <= config.mask_high)
        return torch.where(keep, ratio, 0.0), no, ~keep & mask
    raise LossInputError(f"correction is {config.correction!r}; expected 'truncate', 'mask' or 'none'")


def mopd_loss(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    teacher_logp_sum: torch.Tensor,
    teacher_weight_sum: torch.Tensor,
    loss_mask: torch.Tensor,
    config: LossConfig,
    *,
    orm_advantages: torch.Tensor | None = None,
    denominator: torch.Tensor | int | None = None,
) -> tuple[torch.Tensor, Stats]:
    """L_MOPD with its statistics (formulas in the module docstring).

    Args:
        logprobs: [B, T] log π_θ(y_t) from the trainer's forward; carries the gradient.
        behavior_logprobs: [B, T] log μ(y_t) from the rollout engine; no grad, never written.
        teacher_logp_sum: [B, T] S = Σ_j w_j·log π_j(y_t) (`aggregate_teacher_targets`).
        teacher_weight_sum: [B, T] W = Σ_j w_j.
        loss_mask: [B, T] bool or 0/1; 1 on response tokens that enter the loss. Masked positions may
            hold anything (NaN, ±inf): they change neither the loss nor the gradient.
        config: the `loss:` section (`correction`, `ratio_cap`, `mask_low`, `mask_high`,
            `advantage_clip`, `normalizer`, `orm_alpha`); its `estimator` must be "sampled".
        orm_advantages: [B] or [B, T] A_ORM (e.g. `grpo_advantages`), needed when orm_alpha > 0.
        denominator: None → normalize over this batch; otherwise the whole step's count this batch is a
            shard of (`normalize`; the sum of every shard's `loss_denominator`), so that the shards' losses
            (and gradients) sum to the step's.

    Returns:
        (loss: 0-d tensor in logprobs' dtype promoted to at least float32,
         stats: detached 0-d float32 tensors, keys `mopd/loss` (= loss), `mopd/reverse_kl` (mean over loss tokens
         of W·log π_θ − S, the k1 estimate of Σ_j w_j·KL), `mopd/teacher_student_gap` (mean of
         S/W − log π_θ), `mopd/rho_mean`, `mopd/ratio_capped_frac`, `mopd/ratio_masked_frac`,
         `mopd/advantage_mean`, `mopd/advantage_clipped_frac`, `mopd/tokens`).

    Raises:
        LossInputError: shapes differ, μ requires grad or aliases `logprobs`, a bad mask, the estimator
            is not "sampled", or orm_alpha > 0 without `orm_advantages`.
    """
    if config.estimator != "sampled":
        raise LossInputError(
            f"config.estimator is {config.estimator!r}; mopd_loss implements 'sampled' "
            "(use mopd_hpc.mopd.topk.topk_reverse_kl_loss for 'topk')"
        )
    shape = check_same_shape(
        logprobs=logprobs,
        behavior_logprobs=behavior_logprobs,
        teacher_logp_sum=teacher_logp_sum,
        teacher_weight_sum=teacher_weight_sum,
    )
    if not logprobs.is_floating_point():
        raise LossInputError(f"logprobs has dtype {logprobs.dtype}; expected a float dtype")
    check_behavior_logprobs(behavior_logprobs, logprobs)
    mask = as_bool_mask(loss_mask, shape)
    dtype = torch.promote_types(logprobs.dtype, torch.float32)

    # Every masked position is replaced by 0 before any arithmetic: no NaN/inf leaks into loss or grad.
    lp = torch.where(mask, logprobs.to(dtype), 0.0)
    lp_d = lp.detach()
    mu = torch.where(mask, behavior_logprobs.detach().to(dtype), 0.0)
    s = torch.where(mask, teacher_logp_sum.detach().to(dtype), 0.0)
    w = torch.where(mask, teacher_weight_sum.detach().to(dtype), 0.0)

    rho, capped, dropped = importance_weights(lp_d - mu, mask, config)
    advantage = s - w * lp_d
    clipped = torch.zeros_like(mask)
    if config.advantage_clip is not None:
        a_max = config.advantage_clip
        clipped = (advantage.abs() > a_max) & mask
        advantage = advantage.clamp(-a_max, a_max)
    if config.orm_alpha > 0:
        if orm_advantages is None:
            raise LossInputError(
                f"config.orm_alpha is {config.orm_alpha} but orm_advantages is None; pass the GRPO "
                "advantages [B] (grpo_advantages) or set orm_alpha to 0"
            )
        advantage = compose_advantages(advantage, orm_advantages.detach().to(dtype), config.orm_alpha)
        advantage = torch.where(mask, advantage, 0.0)

    per_token = torch.where(mask, -(rho * advantage) * lp, 0.0)
    loss = normalize(per_token, mask, config.normalizer, denominator)

    gap = torch.where(mask & (w > 0), s / torch.where(w > 0, w, 1.0) - lp_d, 0.0)
    stats: Stats = {
        "mopd/loss": loss.detach().float(),
        "mopd/reverse_kl": masked_mean(w * lp_d - s, mask),
        "mopd/teacher_student_gap": masked_mean(gap, mask),
        "mopd/rho_mean": masked_mean(rho, mask),
        "mopd/ratio_capped_frac": masked_mean(capped, mask),
        "mopd/ratio_masked_frac": masked_mean(dropped, mask),
        "mopd/advantage_mean": masked_mean(advantage, mask),
        "mopd/advantage_clipped_frac": masked_mean(clipped, mask),
        "mopd/tokens": mask.sum(dtype=torch.float32),
    }
    return loss, stats
