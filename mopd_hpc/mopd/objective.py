"""The whole MOPD objective, built once from the `loss:` section; every train engine calls it.

    L = c_rl·L_GRPO + c_d·L_MOPD                                          (`compose.compose_loss`)
    L_MOPD = `loss.mopd_loss`        estimator sampled: A_t = S − W·log π_θ(y_t) [+ α·A_ORM], ρ from
                                     `correction` (truncate | mask | none)      (MiMo eqs. 6-9, AReaL)
           = `topk.topk_reverse_kl`  estimator topk: Σ_j w_j·D_j(t) over each teacher's top-k (MOPD paper)
    L_GRPO = `grpo.grpo_policy_loss` PPO-clip on A_ORM (+ β·KL_k3 to the reference)
    every term: a per-token sum over the step's denominator (`normalize.normalize`, `loss_denominator`)

An engine gives its log-probs: the sampled tokens' [B, T] log π_θ(y_t) (sampled estimator, GRPO) and, for
the top-k estimator, a callable from [B, T, K] ids to their log π_θ (`topk.StudentLogprobs`: `token_logprobs`
of the torch engine's full logits, `vocab_parallel.VocabParallelLogprobs` of megatron's vocabulary shard).
The engine does not choose the loss: this module does, and checks here what no engine may apply:

- estimator topk with orm_alpha > 0: the top-k estimator's gradient is pathwise (no per-token advantage
  for α·A_ORM to join); use rl_coefficient (L_GRPO) with topk.
- estimator topk with correction truncate or mask: the per-position reverse KL does not depend on the
  sampled token y_t at that position, so a per-token ratio π_θ(y_t)/μ(y_t) corrects nothing there
  (`config.loss` resolves the default to none and refuses the others; this is the engines' guard).

Shape legend: B sequences, T response positions, K top-k ids.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mopd_hpc.config.loss import LossConfig
from mopd_hpc.mopd.compose import compose_loss
from mopd_hpc.mopd.grpo import grpo_policy_loss
from mopd_hpc.mopd.loss import Stats, mopd_loss
from mopd_hpc.mopd.normalize import LossInputError
from mopd_hpc.mopd.sft import sft_loss
from mopd_hpc.mopd.targets import TeacherTargets
from mopd_hpc.mopd.topk import StudentLogprobs, TeacherTopK, topk_reverse_kl


class ObjectiveError(LossInputError):
    """A loss section no engine can apply, or a batch that lacks what a positive coefficient's term reads."""


class Objective:
    """L = c_rl·L_GRPO + c_d·L_MOPD of one `LossConfig` (module docstring).

    Raises:
        ObjectiveError: estimator topk with orm_alpha > 0, or with a correction other than none.
    """

    def __init__(self, config: LossConfig) -> None:
        if config.estimator == "topk" and config.distillation_coefficient > 0:
            if config.orm_alpha > 0:
                raise ObjectiveError(
                    f"loss.orm_alpha={config.orm_alpha} with loss.estimator 'topk': the advantage-level "
                    "composition needs the sampled estimator's advantage; use rl_coefficient with 'topk', "
                    "or estimator 'sampled'"
                )
            if config.correction != "none":
                raise ObjectiveError(
                    f"loss.correction={config.correction!r} with loss.estimator 'topk': the per-position "
                    "reverse KL does not depend on the sampled token, a per-token ratio corrects nothing; "
                    "expected correction 'none'"
                )
        self.config = config

    @property
    def uses_topk(self) -> bool:
        """True when the loss reads the student's log-probs of the teachers' top-k ids."""
        return self.config.estimator == "topk" and self.config.distillation_coefficient > 0

    def __call__(
        self,
        *,
        logprobs: torch.Tensor,
        behavior_logprobs: torch.Tensor,
        loss_mask: torch.Tensor,
        targets: TeacherTargets | None = None,
        teacher_topk: Mapping[str, TeacherTopK] | None = None,
        teacher_weights: Mapping[str, torch.Tensor] | None = None,
        student_logprobs: StudentLogprobs | None = None,
        orm_advantages: torch.Tensor | None = None,
        ref_logprobs: torch.Tensor | None = None,
        denominator: torch.Tensor | int | None = None,
        sft: bool = False,
    ) -> tuple[torch.Tensor, Stats]:
        """The composed loss and its terms' statistics; for an SFT warm-up step (`sft`) the cross-entropy
        `sft.sft_loss` of `logprobs` (the teacher's answer tokens) alone, whatever the coefficients.

        Args:
            logprobs: [B, T] log π_θ(y_t) of the sampled tokens (carries the gradient).
            behavior_logprobs: [B, T] log μ(y_t) of the rollout (constant).
            loss_mask: [B, T] bool.
            targets: S, W (`aggregate_teacher_targets`); read by estimator sampled.
            teacher_topk, teacher_weights: per teacher [B, T, K] top-k and [B] weights; estimator topk.
            student_logprobs: ids [B, T, K] → log π_θ (`topk.StudentLogprobs`); estimator topk.
            orm_advantages: [B] A_ORM; read by GRPO (c_rl > 0) and α·A_ORM (orm_alpha > 0).
            ref_logprobs: [B, T] reference log-probs; GRPO's KL penalty (kl_coefficient > 0).
            denominator: the whole step's count (`loss_denominator` summed over shards); None: this batch's.
            sft: the batch is an SFT warm-up step's (`TrainBatch.sft`, `loss.sft_warmup_steps`).

        Returns:
            (0-d loss, stats: `mopd/*` or `topk/*` when c_d > 0, `grpo/*` when c_rl > 0, `sft/*` alone for an
            SFT step; detached float32).

        Raises:
            ObjectiveError: what a positive coefficient's term reads is missing.
            LossInputError: shapes or values the terms refuse.
        """
        cfg = self.config
        if sft:
            return sft_loss(logprobs, loss_mask, cfg.normalizer, denominator)
        stats: Stats = {}

        def distill() -> torch.Tensor:
            if cfg.estimator == "topk":
                if not teacher_topk or teacher_weights is None or student_logprobs is None:
                    raise ObjectiveError(
                        "estimator 'topk' needs batch.teacher_topk and teacher_weights and the student's "
                        "log-probs of their ids; got none"
                    )
                value, s = topk_reverse_kl(
                    student_logprobs, teacher_topk, teacher_weights, loss_mask, cfg, denominator=denominator
                )
            else:
                if targets is None:
                    raise ObjectiveError("estimator 'sampled' needs batch.targets (S, W); got None")
                value, s = mopd_loss(
                    logprobs, behavior_logprobs, targets.logp_sum, targets.weight_sum, loss_mask, cfg,
                    orm_advantages=orm_advantages, denominator=denominator,
                )  # fmt: skip
            stats.update(s)
            return value

        def rl() -> torch.Tensor:
            if orm_advantages is None:
                raise ObjectiveError(
                    f"rl_coefficient={cfg.rl_coefficient} needs batch.orm_advantages; got None"
                )
            value, s = grpo_policy_loss(
                logprobs, behavior_logprobs, orm_advantages, loss_mask, cfg,
                ref_logprobs=ref_logprobs, denominator=denominator,
            )  # fmt: skip
            stats.update(s)
            return value

        return compose_loss(cfg, rl=rl, distill=distill), stats
