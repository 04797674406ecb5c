"""The `topk` estimator: per-position reverse KL over each teacher's top-k tokens.

For position t of sample b and teacher j with top-k set K_j(t) (the teacher's k most likely tokens),
p = π_θ(·|s_t), q_j = π_j(·|s_t) (MOPD paper, Ma et al. arXiv:2606.30406, top-k variant; see
shared/reference/algo_awex.md §1.3):

    D_j(t) = Σ_{v∈K_j(t)} [ p(v)·log(p(v)/q_j(v)) − p(v) + q_j(v) ]
    ℓ_t    = Σ_j w_j·D_j(t)                L = Σ_t m_t·ℓ_t / normalizer (see `normalize`)

The −p + q terms correct the truncation so that p = q on K_j is stationary; with K_j(t) = the whole
vocabulary (k ≥ V) they sum to −1 + 1 and D_j(t) = KL(p ‖ q_j) exactly. The gradient is the pathwise
gradient of D_j w.r.t. the student's logits (no score function, no importance ratio): the positions are
the rollout's, weighted equally.

Shape legend: B sequences, T response positions, V vocabulary, K top-k tokens per position.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from mopd_hpc.config.loss import LossConfig
from mopd_hpc.mopd.logprobs import token_logprobs
from mopd_hpc.mopd.loss import Stats
from mopd_hpc.mopd.normalize import LossInputError, as_bool_mask, masked_mean, normalize


@dataclass(frozen=True, slots=True)
class TeacherTopK:
    """One teacher's top-k at each response position: `indices` [B, T, K] int64 token ids and
    `logprobs` [B, T, K] log π_j of those tokens (float, from the teacher's full softmax)."""

    indices: torch.Tensor
    logprobs: torch.Tensor

    @classmethod
    def from_logits(cls, teacher_logits: torch.Tensor, k: int) -> TeacherTopK:
        """Top-k of a teacher's logits [B, T, V] (for tests and torch scoring engines); K = min(k, V)."""
        dtype = torch.promote_types(teacher_logits.dtype, torch.float32)
        logp = torch.log_softmax(teacher_logits.detach().to(dtype), dim=-1)
        values, indices = logp.topk(min(k, logp.shape[-1]), dim=-1)
        return cls(indices=indices, logprobs=values)


#: Student log-probs of chosen ids: [B, T, K] int64 global token ids → [B, T, K] float log π_θ (with grad).
StudentLogprobs = Callable[[torch.Tensor], torch.Tensor]


def topk_reverse_kl_loss(
    student_logits: torch.Tensor,
    teacher_topk: Mapping[str, TeacherTopK],
    teacher_weights: Mapping[str, torch.Tensor],
    loss_mask: torch.Tensor,
    config: LossConfig,
    *,
    denominator: torch.Tensor | int | None = None,
) -> tuple[torch.Tensor, Stats]:
    """L_MOPD of the `topk` estimator from full-vocabulary logits (formula in the module docstring).

    Args:
        student_logits: [B, T, V] student logits at the response positions (any float dtype; the
            softmax is computed in float32 without a float32 [B, T, V] copy, or in float64 for float64).
        teacher_topk, teacher_weights, loss_mask, config, denominator: as `topk_reverse_kl`.

    Returns / Raises: as `topk_reverse_kl`; also LossInputError when student_logits is not [B, T, V].
    """
    if student_logits.dim() != 3:
        raise LossInputError(f"student_logits has shape {list(student_logits.shape)}; expected [B, T, V]")
    return topk_reverse_kl(
        lambda ids: token_logprobs(student_logits, ids),
        teacher_topk,
        teacher_weights,
        loss_mask,
        config,
        denominator=denominator,
    )


def topk_reverse_kl(
    student_logprobs: StudentLogprobs,
    teacher_topk: Mapping[str, TeacherTopK],
    teacher_weights: Mapping[str, torch.Tensor],
    loss_mask: torch.Tensor,
    config: LossConfig,
    *,
    denominator: torch.Tensor | int | None = None,
) -> tuple[torch.Tensor, Stats]:
    """L_MOPD of the `topk` estimator (formula in the module docstring), the student's log-probs given as a
    callable: `token_logprobs` of full logits, or `vocab_parallel.VocabParallelLogprobs` of one rank's
    vocabulary shard (called once per teacher, in `teacher_topk`'s order: a collective there).

    Args:
        student_logprobs: [B, T, K] ids → [B, T, K] log π_θ of those ids (float, carries the gradient).
        teacher_topk: teacher_id → `TeacherTopK` ([B, T, K] each; K may differ between teachers).
        teacher_weights: teacher_id → [B] route weight w_j of each sample (0: the teacher's rows are
            ignored, e.g. not scored); every teacher in `teacher_topk` needs an entry.
        loss_mask: [B, T] bool or 0/1.
        config: `normalizer`.
        denominator: None → normalize over this batch; otherwise the whole step's count this batch is a
            shard of (`normalize`; the sum of every shard's `loss_denominator`), so that the shards' losses
            (and gradients) sum to the step's.

    Returns:
        (loss 0-d, stats: `topk/loss`, `topk/reverse_kl` (mean ℓ_t over loss tokens),
        `topk/teacher_mass` (mean Σ_{v∈K} q_j(v), weighted by w_j/W), detached float32).

    Raises:
        LossInputError: shapes disagree or a teacher has no weight entry.
    """
    if loss_mask.dim() != 2:
        raise LossInputError(f"loss_mask has shape {list(loss_mask.shape)}; expected [B, T]")
    batch, length = loss_mask.shape
    mask = as_bool_mask(loss_mask, torch.Size((batch, length)))
    device = loss_mask.device
    dtype: torch.dtype | None = None
    per_pos = mass = total_w = None
    for tid, top in teacher_topk.items():
        if tid not in teacher_weights:
            raise LossInputError(f"teacher {tid!r} has top-k log-probs but no entry in teacher_weights")
        if top.indices.shape != top.logprobs.shape or top.indices.shape[:2] != (batch, length):
            raise LossInputError(
                f"teacher {tid!r}: indices {list(top.indices.shape)} and logprobs "
                f"{list(top.logprobs.shape)}; expected equal [{batch}, {length}, K]"
            )
        if teacher_weights[tid].shape != (batch,):
            raise LossInputError(
                f"teacher_weights[{tid!r}] has shape {list(teacher_weights[tid].shape)}; expected [{batch}]"
            )
        w_raw = teacher_weights[tid].detach()
        active = mask & (w_raw > 0)[:, None]
        idx = torch.where(active[..., None], top.indices, 0)
        lp = student_logprobs(idx)
        if dtype is None:
            dtype = torch.promote_types(lp.dtype, torch.float32)
            per_pos = torch.zeros((batch, length), dtype=dtype, device=device)
            mass = torch.zeros_like(per_pos)
            total_w = torch.zeros(batch, dtype=dtype, device=device)
        lp = lp.to(dtype)
        w = w_raw.to(dtype)
        lq = torch.where(active[..., None], top.logprobs.detach().to(dtype), 0.0)
        p, q = lp.exp(), lq.exp()
        d = (p * (lp - lq) - p + q).sum(dim=-1)
        per_pos = per_pos + torch.where(active, w[:, None] * d, 0.0)
        mass = mass + torch.where(active, w[:, None] * q.sum(dim=-1), 0.0)
        total_w = total_w + w
    if per_pos is None or mass is None or total_w is None:
        raise LossInputError("teacher_topk is empty; expected at least one teacher's [B, T, K] top-k")
    loss = normalize(torch.where(mask, per_pos, 0.0), mask, config.normalizer, denominator)
    stats: Stats = {
        "topk/loss": loss.detach().float(),
        "topk/reverse_kl": masked_mean(per_pos, mask),
        "topk/teacher_mass": masked_mean(mass / total_w.clamp(min=1e-30)[:, None], mask),
    }
    return loss, stats
