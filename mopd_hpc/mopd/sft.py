"""The SFT loss of the warm-up steps (`loss.sft_warmup_steps`): cross-entropy on the teachers' answers.

    L_SFT = Σ_t m_t·(−log π_θ(y_t)) / normalizer        (`normalize`: token-mean or seq-mean-token-mean)

y is the route teacher's greedy answer (not a student sample): the warm-up steps are supervised fine-tuning
on teacher samples, the first stage of the SFT-then-on-policy recipe (Qwen3 and MiMo run MOPD after an SFT
stage; Agarwal et al., GKD, arXiv:2306.13649, mix supervised and on-policy data). No behavior policy μ, no
teacher score and no importance ratio enter it.

Shape legend: B sequences, T response positions.
"""

from __future__ import annotations

import torch

from mopd_hpc.mopd.loss import Stats
from mopd_hpc.mopd.normalize import Normalizer, as_bool_mask, normalize


def sft_loss(
    logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    normalizer: Normalizer,
    denominator: torch.Tensor | int | None = None,
) -> tuple[torch.Tensor, Stats]:
    """L_SFT (module docstring) with its statistics.

    Args:
        logprobs: [B, T] log π_θ(y_t) of the answer tokens (carries the gradient); anything at masked positions.
        loss_mask: [B, T] bool or 0/1, 1 on the answer's tokens.
        normalizer: "token-mean" or "seq-mean-token-mean".
        denominator: None → this batch's count; else the whole step's (`normalize`).

    Returns:
        (0-d loss in logprobs' dtype promoted to at least float32, stats {`sft/loss`, `sft/tokens`}: detached
        float32 0-d tensors).

    Raises:
        LossInputError: a bad mask or normalizer.
    """
    mask = as_bool_mask(loss_mask, logprobs.shape)
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    per_token = torch.where(mask, -logprobs.to(dtype), 0.0)
    loss = normalize(per_token, mask, normalizer, denominator)
    return loss, {"sft/loss": loss.detach().float(), "sft/tokens": mask.sum(dtype=torch.float32)}
