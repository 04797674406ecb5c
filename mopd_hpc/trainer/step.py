"""TRAIN inputs and the metrics line of one step.

`train_batch` assembles the `TrainBatch` the bound loss reads: tokens, μ (as the rollout gave it), S and W,
the teachers' top-k and per-row weights (topk estimator), and A_ORM = GRPO group-normalized rewards when a
loss term needs them (`ExecutionPlan.requires_reward`).

`step_metrics` maps the engine's statistics onto the metrics contract (`records/metrics_schema.py`):
loss terms, `mopd/*` diagnostics, reward and accuracy per route, tokens/s and seconds per phase. With the
`sampled` estimator the `mopd/*` values are the loss's own statistics; with `topk` the reverse KL is the
top-k loss's, and the importance-ratio and gap statistics are measured on the sampled tokens with the
student's log-probs just before the step (`ratio_stats`): the topk loss itself applies no ratio.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mopd_hpc.config.loss import LossConfig
from mopd_hpc.engines.batch import TrainBatch
from mopd_hpc.mopd.grpo import grpo_advantages
from mopd_hpc.mopd.loss import importance_weights
from mopd_hpc.mopd.normalize import masked_mean
from mopd_hpc.mopd.plan import ExecutionPlan
from mopd_hpc.trainer.rollout_phase import Rollouts
from mopd_hpc.trainer.teacher_phase import TeacherScores

#: Phase timing keys of the contract, by phase name.
PHASE_TIME_KEYS = {
    "rollout": "time/rollout_s",
    "teacher": "time/teacher_s",
    "drain": "time/drain_s",
    "train": "time/train_s",
    "sync": "time/sync_s",
}


def train_batch(
    rollouts: Rollouts, scores: TeacherScores | None, plan: ExecutionPlan, samples_per_prompt: int
) -> TrainBatch:
    """The step's `TrainBatch` (module docstring)."""
    orm = None
    if plan.requires_reward:
        orm = grpo_advantages(rollouts.rewards, samples_per_prompt)
    return TrainBatch.create(
        rollouts.tokens,
        rollouts.behavior_logprobs,
        targets=scores.targets if scores is not None else None,
        teacher_topk=scores.topk if scores is not None else None,
        teacher_weights=scores.weights if scores is not None and scores.topk else None,
        orm_advantages=orm,
    )


def ratio_stats(student_logprobs: torch.Tensor, batch: TrainBatch, loss: LossConfig) -> dict[str, float]:
    """`mopd/rho_mean`, `mopd/ratio_capped_frac`, `mopd/ratio_masked_frac` of r_t = π_θ(y_t)/μ(y_t) under
    `loss.correction`, and `mopd/teacher_student_gap` = mean(S/W − log π_θ(y_t)), over response tokens."""
    mask = batch.tokens.response_mask
    lp = torch.where(mask, student_logprobs.float().cpu(), 0.0)
    mu = torch.where(mask, batch.behavior_logprobs.float(), 0.0)
    rho, capped, dropped = importance_weights(lp - mu, mask, loss)
    out = {
        "mopd/rho_mean": float(masked_mean(rho, mask)),
        "mopd/ratio_capped_frac": float(masked_mean(capped, mask)),
        "mopd/ratio_masked_frac": float(masked_mean(dropped, mask)),
    }
    if batch.targets is not None:
        s, w = batch.targets.logp_sum, batch.targets.weight_sum
        ok = mask & (w > 0)
        gap = torch.where(ok, torch.where(ok, s, 0.0) / torch.where(ok, w, 1.0) - lp, 0.0)
        out["mopd/teacher_student_gap"] = float(masked_mean(gap, ok))
    return out


def step_metrics(
    stats: Mapping[str, float],
    rollouts: Rollouts,
    timings: Mapping[str, float],
    loss: LossConfig,
    routes: tuple[str, ...],
) -> dict[str, Any]:
    """The metrics line's values (without `step` and `ts`).

    stats: `TorchTrainEngine.train_step` output (with `ratio_stats` observed under the topk estimator).
    timings: phase name → seconds (absent phases: 0). routes: every route of the run (a route absent from
    this step's rollouts gets NaN reward/accuracy, written as null).
    """
    topk = loss.estimator == "topk"
    mopd_loss = stats.get("topk/loss" if topk else "mopd/loss", 0.0)
    values: dict[str, Any] = {
        "loss/total": stats["loss"],
        "loss/mopd": mopd_loss if loss.distillation_coefficient > 0 else 0.0,
        "loss/rl": stats.get("grpo/loss", 0.0),
        "mopd/reverse_kl": stats.get("topk/reverse_kl" if topk else "mopd/reverse_kl", float("nan")),
    }
    for key in (
        "mopd/rho_mean",
        "mopd/ratio_capped_frac",
        "mopd/ratio_masked_frac",
        "mopd/teacher_student_gap",
    ):
        values[key] = stats.get(key, float("nan"))
    means = rollouts.route_means()
    for route in routes:
        reward, accuracy = means.get(route, (float("nan"), float("nan")))
        values[f"reward/{route}"] = reward
        values[f"accuracy/{route}"] = accuracy
    total_s = sum(timings.values())
    values["perf/tokens_per_s"] = rollouts.response_tokens / total_s if total_s > 0 else 0.0
    for phase, key in PHASE_TIME_KEYS.items():
        values[key] = float(timings.get(phase, 0.0))
    values["train/grad_norm"] = stats.get("grad_norm", float("nan"))
    values["train/lr"] = stats.get("lr", float("nan"))
    values["train/response_tokens"] = float(rollouts.response_tokens)
    if loss.estimator == "topk" and "topk/teacher_mass" in stats:
        values["topk/teacher_mass"] = stats["topk/teacher_mass"]
    return values
