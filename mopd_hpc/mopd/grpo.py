"""GRPO: group-normalized outcome advantages and the PPO-clip policy loss L_RL.

    A_ORM,i = (r_i − mean_{g(i)} r) / (std_{g(i)} r + ε)            GRPO (Shao et al. 2024, arXiv:2402.03300)
    ratio_t = π_θ(y_t) / π_old(y_t)
    ℓ_t     = −min(ratio_t·A_t, clip(ratio_t, 1 − ε_clip, 1 + ε_clip)·A_t)      PPO (arXiv:1707.06347)
            + β·KL_k3(π_θ ‖ π_ref)_t     KL_k3 = exp(ref − lp) − (ref − lp) − 1   (Schulman's k3 estimator)
    L_RL    = Σ_t m_t·ℓ_t / normalizer

The group std is the population std (divide by n; verl `torch.std` uses n − 1 — a constant factor that
only rescales the advantage). π_old is the behavior policy's log-probs: read only, never written.

Shape legend: B sequences (B = n_groups·group_size, contiguous groups), T response positions.
"""

from __future__ import annotations

import torch

from mopd_hpc.config.loss import LossConfig
from mopd_hpc.mopd.compose import compose_advantages
from mopd_hpc.mopd.loss import Stats, check_behavior_logprobs, check_same_shape
from mopd_hpc.mopd.normalize import LossInputError, as_bool_mask, masked_mean, normalize

#: ε added to the group std (verl's GRPO default).
GRPO_STD_EPS = 1e-6


def grpo_advantages(
    rewards: torch.Tensor, group_size: int, *, scale_by_std: bool = True, eps: float = GRPO_STD_EPS
) -> torch.Tensor:
    """Group-normalized outcome advantages.

    Args:
        rewards: [B] outcome rewards, samples of one prompt contiguous (B = n_groups·group_size).
        group_size: samples per prompt, ≥ 1.
        scale_by_std: divide by (std + eps); False gives mean-centred rewards (Dr. GRPO, tinker).
        eps: added to the std.

    Returns:
        [B] float32 advantages (0 for a group of identical rewards and for group_size 1).

    Raises:
        LossInputError: rewards not 1-d, group_size < 1, or B not a multiple of group_size.
    """
    if rewards.dim() != 1:
        raise LossInputError(f"rewards has shape {list(rewards.shape)}; expected [B]")
    if group_size < 1 or rewards.shape[0] % group_size:
        raise LossInputError(f"group_size is {group_size}; expected >= 1 and dividing B = {rewards.shape[0]}")
    grouped = rewards.detach().float().reshape(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_by_std:
        centred = centred / (grouped.std(dim=1, unbiased=False, keepdim=True) + eps)
    return centred.reshape(-1)


def grpo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    config: LossConfig,
    *,
    ref_logprobs: torch.Tensor | None = None,
    denominator: torch.Tensor | int | None = None,
) -> tuple[torch.Tensor, Stats]:
    """L_RL: the PPO-clip surrogate with GRPO advantages and an optional k3 KL penalty.

    Args:
        logprobs: [B, T] log π_θ(y_t), carries the gradient.
        old_logprobs: [B, T] log π_old(y_t) (the behavior log-probs); no grad, never written.
        advantages: [B] (broadcast over T) or [B, T].
        loss_mask: [B, T] bool or 0/1.
        config: `ppo_clip` (ε_clip), `kl_coefficient` (β), `normalizer`.
        ref_logprobs: [B, T] reference-model log-probs, required when β > 0.
        denominator: None → normalize over this batch; otherwise the whole step's count this batch is a
            shard of (`normalize`; the sum of every shard's `loss_denominator`), so that the shards' losses
            (and gradients) sum to the step's.

    Returns:
        (loss 0-d, stats: `grpo/loss`, `grpo/ratio_mean`, `grpo/clipped_frac`, `grpo/advantage_mean`,
        `grpo/kl_ref`), stats detached float32.
    """
    shape = check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs)
    check_behavior_logprobs(old_logprobs, logprobs)
    mask = as_bool_mask(loss_mask, shape)
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    lp = torch.where(mask, logprobs.to(dtype), 0.0)
    old = torch.where(mask, old_logprobs.detach().to(dtype), 0.0)
    adv = torch.where(
        mask,
        compose_advantages(torch.zeros(shape, dtype=dtype, device=lp.device), advantages.detach(), 1.0),
        0.0,
    )

    ratio = torch.exp(lp - old)
    eps = config.ppo_clip
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - eps, 1 + eps) * adv
    per_token = -torch.minimum(unclipped, clipped)
    kl = torch.zeros_like(lp)
    if config.kl_coefficient > 0:
        if ref_logprobs is None:
            raise LossInputError(
                f"config.kl_coefficient is {config.kl_coefficient} but ref_logprobs is None; "
                "score the reference model or set kl_coefficient to 0"
            )
        check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
        delta = torch.where(mask, ref_logprobs.detach().to(dtype), 0.0) - lp
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + config.kl_coefficient * kl
    per_token = torch.where(mask, per_token, 0.0)
    loss = normalize(per_token, mask, config.normalizer, denominator)
    stats: Stats = {
        "grpo/loss": loss.detach().float(),
        "grpo/ratio_mean": masked_mean(ratio, mask),
        "grpo/clipped_frac": masked_mean((clipped < unclipped) & mask, mask),
        "grpo/advantage_mean": masked_mean(adv, mask),
        "grpo/kl_ref": masked_mean(kl, mask),
    }
    return loss, stats
