"""The `loss:` section of the run config: MOPD loss, mismatch correction, RL composition.

Formulas: ../shared/DESIGN.md §3; MiMo-V2-Flash report §4.4 eqs. 5-9 (advantage-level composition,
IcePop mask, |y| normalizer); AReaL feature/mopd (truncated importance ratio, C = 5; loss-level
composition); MOPD paper (advantage clip, A_max = 5; top-k estimator).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from mopd_hpc.config.base import Section
from mopd_hpc.config.problems import Problem, raise_if_any

#: AReaL feature/mopd default cap of the truncated importance ratio.
DEFAULT_RATIO_CAP = 5.0
#: MOPD paper's top-k estimator default (k teacher tokens per position).
DEFAULT_TOPK = 64


class LossConfig(Section):
    """MOPD loss: L = c_rl·L_RL + c_d·L_MOPD, with optional advantage-level ORM term α·A_ORM."""

    estimator: Literal["sampled", "topk"] = Field(
        "sampled",
        description="'sampled': per-token estimator A_t·log π_θ(y_t) on the sampled token (AReaL, MiMo). "
        "'topk': per-position reverse KL over the teacher's top-k tokens with the MOPD paper's "
        "truncation correction; exact reverse KL when k >= vocabulary size.",
    )
    topk: int = Field(DEFAULT_TOPK, ge=1, description="k of the 'topk' estimator, in tokens.")
    correction: Literal["truncate", "mask", "none"] = Field(
        None,  # unset: resolved by `_resolve_correction` (truncate with sampled, none with topk)
        description="Train/inference mismatch correction on r_t = π_θ(y_t)/μ(y_t): 'truncate' "
        "ρ = sg(min(r_t, ratio_cap)) (AReaL); 'mask' ρ = sg(r_t) inside [mask_low, mask_high], 0 "
        "outside (IcePop, MiMo eq. 8); 'none' ρ = 1. Unset: 'truncate' with estimator 'sampled', 'none' "
        "with 'topk' (whose per-position reverse KL does not depend on the sampled token: 'truncate' and "
        "'mask' are refused there).",
    )
    ratio_cap: float = Field(DEFAULT_RATIO_CAP, gt=0, description="C of 'truncate' (dimensionless).")
    mask_low: float = Field(0.5, ge=0, description="ε_low of 'mask': lowest kept r_t (dimensionless).")
    mask_high: float = Field(2.0, gt=0, description="ε_high of 'mask': highest kept r_t (dimensionless).")
    advantage_clip: float | None = Field(
        None, gt=0, description="A_max: clip the distillation advantage to ±A_max; null = no clip."
    )
    normalizer: Literal["token-mean", "seq-mean-token-mean"] = Field(
        "token-mean",
        description="'token-mean': sum over unmasked tokens / their count in the batch; "
        "'seq-mean-token-mean': mean over sequences of each sequence's token mean (MiMo eq. 7, |y|).",
    )
    distillation_coefficient: float = Field(1.0, ge=0, description="c_d, weight of L_MOPD.")
    rl_coefficient: float = Field(0.0, ge=0, description="c_rl, weight of the GRPO policy loss L_RL.")
    orm_alpha: float = Field(
        0.0, ge=0, description="α of the advantage-level composition A_t + α·A_ORM (MiMo eq. 9)."
    )
    ppo_clip: float = Field(0.2, gt=0, lt=1, description="ε of the GRPO/PPO clipped surrogate.")
    kl_coefficient: float = Field(
        0.0, ge=0, description="β of a KL penalty to a reference model inside L_RL; > 0 needs a reference."
    )
    sft_warmup_steps: int = Field(
        0,
        ge=0,
        description="Steps 1..N of the run are SFT steps: the route teacher's greedy answer to each prompt "
        "(generated on its teacher server; the route's highest-weight teacher) trained with cross-entropy "
        "(`mopd/sft.py`, normalized as `normalizer`) in place of the rollout and the loss above; steps "
        "N+1.. are the configured objective. 0 = off (every step on-policy). In steps, at most `steps`. "
        "Exclusive with sft_warmup_ratio.",
    )
    sft_warmup_ratio: float | None = Field(
        None,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="The SFT warm-up as a fraction of the run's steps (as optimizer.warmup_ratio): steps "
        "1..round(sft_warmup_ratio·steps) are SFT steps (see sft_warmup_steps), so the warm-up scales with "
        "`steps`. null = off (sft_warmup_steps counts). Exclusive with sft_warmup_steps.",
    )
    router_aux_loss_coefficient: float | None = Field(
        None,
        ge=0,
        description="Weight of the router's load-balancing loss (Switch Transformer eqs. 4-6) added to L for "
        "a mixture-of-experts actor (engines torch and megatron); null = the actor's config.json "
        "`router_aux_loss_coef` (Qwen3-MoE: 0.001). Set > 0 for a dense actor is refused at --check (no router).",
    )
    router_z_loss_coefficient: float = Field(
        0.0,
        ge=0,
        description="Weight of the router z-loss (ST-MoE eq. 5: mean logsumexp² of the router logits) added "
        "to L for a mixture-of-experts actor (engines torch and megatron); 0 = off. > 0 for a dense actor is refused at "
        "--check.",
    )

    def sft_steps(self, steps: int | None) -> int:
        """The SFT warm-up's length in steps: round(sft_warmup_ratio · steps) (Python's round, as
        optimizer.warmup_ratio's in engines/lr_schedule.py) when the ratio is set, else sft_warmup_steps.

        steps: the run's `steps`; None only where the ratio is unset.

        Raises:
            ValueError: the ratio is set and `steps` is None.
        """
        if self.sft_warmup_ratio is None:
            return self.sft_warmup_steps
        if steps is None:
            raise ValueError("loss.sft_warmup_ratio is set: the warm-up's length needs the run's steps")
        return round(self.sft_warmup_ratio * steps)

    @model_validator(mode="before")
    @classmethod
    def _resolve_correction(cls, data: Any) -> Any:
        """An unset (or null) correction resolves by the estimator: 'none' for topk, else 'truncate'."""
        if isinstance(data, dict) and data.get("correction") is None:
            data = {**data, "correction": "none" if data.get("estimator") == "topk" else "truncate"}
        return data

    @model_validator(mode="after")
    def _check(self) -> LossConfig:
        problems = []
        if self.estimator == "topk" and self.correction != "none":
            problems.append(
                Problem(
                    "correction",
                    f"loss.correction {self.correction!r} has no effect with loss.estimator 'topk': the "
                    "per-position reverse KL does not depend on the sampled token, so a per-token ratio "
                    "π_θ(y_t)/μ(y_t) corrects nothing",
                    self.correction,
                    "correction: none (the default with topk), or estimator: sampled",
                )
            )
        if self.estimator == "topk" and self.orm_alpha > 0:
            problems.append(
                Problem(
                    "orm_alpha",
                    f"loss.orm_alpha {self.orm_alpha} with loss.estimator 'topk': the advantage-level "
                    "composition A_t + α·A_ORM needs the sampled estimator's per-token advantage",
                    self.orm_alpha,
                    "orm_alpha: 0 and rl_coefficient > 0 (GRPO at loss level) with topk, or estimator: sampled",
                )
            )
        if self.distillation_coefficient == 0 and self.rl_coefficient == 0:
            problems.append(
                Problem(
                    "distillation_coefficient",
                    "distillation_coefficient and rl_coefficient are both 0: nothing to train "
                    f"(orm_alpha={self.orm_alpha} alone does not make a loss)",
                    self.distillation_coefficient,
                    "set one of them > 0",
                )
            )
        if self.sft_warmup_ratio is not None and self.sft_warmup_steps > 0:
            problems.append(
                Problem(
                    "sft_warmup_ratio",
                    f"loss.sft_warmup_ratio {self.sft_warmup_ratio} and loss.sft_warmup_steps "
                    f"{self.sft_warmup_steps} are both set: each gives the SFT warm-up's length",
                    self.sft_warmup_ratio,
                    "one of them: sft_warmup_ratio: null, or drop sft_warmup_steps",
                )
            )
        warmup, field = (
            (self.sft_warmup_ratio, "sft_warmup_ratio")
            if self.sft_warmup_ratio is not None
            else (self.sft_warmup_steps, "sft_warmup_steps")
        )
        if warmup > 0 and self.distillation_coefficient == 0:
            problems.append(
                Problem(
                    field,
                    f"loss.{field} {warmup} with distillation_coefficient 0: the "
                    "warm-up trains on the teachers' greedy answers, and a run without distillation starts "
                    "no teacher",
                    warmup,
                    f"{field}: 0, or distillation_coefficient > 0",
                )
            )
        if self.correction == "mask" and self.mask_low >= self.mask_high:
            problems.append(
                Problem(
                    "mask_low",
                    f"mask_low ({self.mask_low}) must be < mask_high ({self.mask_high}) for correction 'mask'",
                    self.mask_low,
                    f"a value below mask_high ({self.mask_high})",
                )
            )
        raise_if_any(problems)  # RuleViolation: a ValueError listing each problem with its field
        return self
