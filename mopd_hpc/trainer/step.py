"""TRAIN inputs and the metrics line of one step.

`shard_batch` assembles the `TrainBatch` the bound loss reads for one data-parallel rank's rows of the step:
tokens, μ (as the rollout gave it), S and W, the teachers' top-k and per-row weights (topk estimator), and
A_ORM = GRPO group-normalized rewards of the whole step when a loss term needs them
(`ExecutionPlan.requires_reward`; `orm_advantages`, on rank 0, before the split).

`step_metrics` maps the engine's statistics onto the metrics contract (`records/metrics_schema.py`):
loss terms, `mopd/*` diagnostics, reward and accuracy per route, tokens/s and seconds per phase. With the
`sampled` estimator the `mopd/*` values are the loss's own statistics; with `topk` the reverse KL is the
top-k loss's, and the importance-ratio and gap statistics are measured on the sampled tokens with the
student's log-probs just before the step (`ratio_sums` on each rank, summed over the ranks): the topk loss itself applies no ratio.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mopd_hpc.config.loss import LossConfig
from mopd_hpc.engines.batch import TrainBatch
from mopd_hpc.mopd.grpo import grpo_advantages
from mopd_hpc.mopd.loss import importance_weights
from mopd_hpc.mopd.plan import ExecutionPlan
from mopd_hpc.records.metrics_schema import (
    ROUTER_KEYS,
    TRAIN_FORWARD_BACKWARD_KEY,
    TRAIN_OPTIMIZER_KEY,
    TRAIN_PREPARE_KEY,
)
from mopd_hpc.trainer.rollout_phase import Rollouts
from mopd_hpc.trainer.shards import Shard
from mopd_hpc.trainer.step_record import ControlRecord
from mopd_hpc.trainer.teacher_phase import TeacherScores

#: Phase timing keys of the contract, by phase name.
PHASE_TIME_KEYS = {
    "rollout": "time/rollout_s",
    "teacher": "time/teacher_s",
    "drain": "time/drain_s",
    "train": "time/train_s",
    "sync": "time/sync_s",
}


def shard_batch(
    record: ControlRecord,
    shard: Shard,
    scores: TeacherScores | None,
    ref_logprobs: torch.Tensor | None = None,
    sft: bool = False,
) -> TrainBatch:
    """The `TrainBatch` of rows [shard.start, shard.stop) of a step record: tokens and μ of those rows (as the
    rollout gave them), S and W, the teachers' top-k and per-row weights (topk estimator) from `scores` (the
    shard's own), the shard's slice of the step's A_ORM (computed over every row by rank 0), the
    reference model's [b, T] log-probs of the shard's rows (KL penalty only; None otherwise), and the
    rollout's routed experts of those rows (rollout routing replay only); `sft`: an SFT warm-up step's
    (`TrainBatch.sft`)."""
    tokens = record.tokens(shard.start, shard.stop)
    return TrainBatch.create(
        tokens,
        record.behavior(tokens, shard.start, shard.stop),
        routed_experts=record.routed_experts(tokens, shard.start, shard.stop),
        targets=scores.targets if scores is not None else None,
        teacher_topk=scores.topk if scores is not None else None,
        teacher_weights=scores.weights if scores is not None and scores.topk else None,
        orm_advantages=record.orm_advantages(shard.start, shard.stop),
        ref_logprobs=ref_logprobs,
        sft=sft,
    )


def orm_advantages(
    rewards: torch.Tensor, plan: ExecutionPlan, samples_per_prompt: int
) -> torch.Tensor | None:
    """[B] float32 A_ORM = GRPO group-normalized rewards of the whole step, when a loss term reads them."""
    return grpo_advantages(rewards, samples_per_prompt) if plan.requires_reward else None


#: The train/inference mismatch: mean |log π_θ(y_t) − log μ(y_t)| over response tokens (nats).
MISMATCH_KEY = "mopd/logprob_mismatch"
#: `ratio_sums` keys → the metric each (sum, count) pair gives.
RATIO_KEYS = (
    "mopd/rho_mean",
    "mopd/ratio_capped_frac",
    "mopd/ratio_masked_frac",
    "mopd/teacher_student_gap",
    MISMATCH_KEY,
)


def ratio_sums(
    student_logprobs: torch.Tensor, batch: TrainBatch, loss: LossConfig
) -> dict[str, tuple[float, float]]:
    """(sum, count) over response tokens of ρ, capped, masked under `loss.correction` (r_t = π_θ(y_t)/μ(y_t)),
    of |log π_θ(y_t) − log μ(y_t)| (`MISMATCH_KEY`) and of the gap S/W − log π_θ(y_t) (tokens with W > 0):
    summed over the data-parallel ranks, then divided (`ratio_means`), they are the whole step's `mopd/*`
    statistics."""
    mask = batch.tokens.response_mask.cpu()
    lp = torch.where(mask, student_logprobs.float().cpu(), 0.0)
    mu = torch.where(mask, batch.behavior_logprobs.float().cpu(), 0.0)
    rho, capped, dropped = importance_weights(lp - mu, mask, loss)
    count = float(mask.sum())

    def total(values: torch.Tensor, where: torch.Tensor) -> float:
        return float(torch.where(where, values.detach().float(), 0.0).sum())

    out = {
        "mopd/rho_mean": (total(rho, mask), count),
        "mopd/ratio_capped_frac": (total(capped, mask), count),
        "mopd/ratio_masked_frac": (total(dropped, mask), count),
        MISMATCH_KEY: (total((lp - mu).abs(), mask), count),
    }
    if batch.targets is not None:
        s, w = batch.targets.logp_sum.cpu(), batch.targets.weight_sum.cpu()
        ok = mask & (w > 0)
        gap = torch.where(ok, torch.where(ok, s, 0.0) / torch.where(ok, w, 1.0) - lp, 0.0)
        out["mopd/teacher_student_gap"] = (total(gap, ok), float(ok.sum()))
    return out


def ratio_means(sums: Mapping[str, tuple[float, float]]) -> dict[str, float]:
    """sum / count of each `ratio_sums` entry (0 for an empty count, as `masked_mean`)."""
    return {k: s / max(c, 1.0) for k, (s, c) in sums.items()}


def step_metrics(
    stats: Mapping[str, float],
    rollouts: Rollouts,
    timings: Mapping[str, float],
    loss: LossConfig,
    routes: tuple[str, ...],
) -> dict[str, Any]:
    """The metrics line's values (without `step` and `ts`).

    stats: `TorchTrainEngine.train_step` output (with `ratio_means` under the topk estimator).
    timings: phase name → seconds (absent phases: 0; "reference": the reference model's part of "teacher",
    "prepare": the `before_train` part of "train", neither added again to the total; `time/train/prepare_s`
    is written from "prepare", `time/train/forward_backward_s` and `time/train/optimizer_s` from `stats`,
    each 0 when absent). routes: every route of the run (a route absent from
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
    total_s = sum(float(timings.get(phase, 0.0)) for phase in PHASE_TIME_KEYS)
    values["perf/tokens_per_s"] = rollouts.response_tokens / total_s if total_s > 0 else 0.0
    for phase, key in PHASE_TIME_KEYS.items():
        values[key] = float(timings.get(phase, 0.0))
    values[TRAIN_PREPARE_KEY] = float(timings.get("prepare", 0.0))
    for key in (TRAIN_FORWARD_BACKWARD_KEY, TRAIN_OPTIMIZER_KEY):
        values[key] = float(stats.get(key, 0.0))
    if loss.rl_coefficient > 0 and loss.kl_coefficient > 0:
        values["ref/kl"] = stats.get("grpo/kl_ref", float("nan"))
        values["time/reference_s"] = float(timings.get("reference", 0.0))
    values["train/grad_norm"] = stats.get("grad_norm", float("nan"))
    values["train/lr"] = stats.get("lr", float("nan"))
    values["train/response_tokens"] = float(rollouts.response_tokens)
    values["train/prompt_tokens"] = float(sum(rollouts.starts))  # the rows' prompts (each sample's copy)
    if "mopd/teacher_refused_tokens" in stats:  # −inf teacher log-probs taken as the floor (mopd/targets.py)
        values["mopd/teacher_refused_tokens"] = stats["mopd/teacher_refused_tokens"]
    if "sft/loss" in stats:  # an SFT warm-up step (loss.sft_warmup_steps): its cross-entropy, = loss/total
        values["loss/sft"] = stats["sft/loss"]
    if MISMATCH_KEY in stats:
        values[MISMATCH_KEY] = stats[MISMATCH_KEY]
    for key in ROUTER_KEYS:  # a mixture-of-experts actor with a router loss (engines/moe_routing.py)
        if key in stats:
            values[key] = stats[key]
    if loss.estimator == "topk" and "topk/teacher_mass" in stats:
        values["topk/teacher_mass"] = stats["topk/teacher_mass"]
    return values
