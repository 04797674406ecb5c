"""The actor's learning-rate schedule (`OptimizerConfig.schedule`): one definition, two implementations.

lr(s) = lr · f(s) for optimizer step s = 0, 1, ... (the lr step s + 1 trains at): a linear warm-up
f = s / W over the first W = round(warmup_ratio · total_steps) steps, then, with r = min_lr_ratio and
p = (s − W) / (D − W), D = max(total_steps, W + 1) the decay steps:
`constant` f = 1; `cosine` f = r + (1 − r) · ½(1 + cos(π·p)); `linear` f = r + (1 − r)(1 − p); min_lr after D.
This is megatron-core's `OptimizerParamScheduler` (megatron/core/optimizer_param_scheduler.py `get_lr`, after
Loshchilov & Hutter, SGDR, https://openreview.net/pdf?id=BJYwwY9ll) with init_lr 0, max_lr lr, min_lr r·lr,
lr_warmup_steps W, lr_decay_steps D: the megatron engine runs that scheduler itself
(`megatron_scheduler_args`); the torch engine runs transformers' `cosine_with_min_lr` / `constant_with_warmup`
(the same f) and `linear_lr` for `linear` (transformers' `linear` decays to 0, not to r·lr).
tests/engines/test_lr_schedule.py checks the three against each other step by step.

The scheduler's state travels in the engine's checkpoint, so a resumed run continues the schedule where it
stopped.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mopd_hpc.config.models import OptimizerConfig
from mopd_hpc.engines.protocol import EngineError


def schedule_steps(config: OptimizerConfig, total_steps: int) -> tuple[int, int]:
    """(W, D): the warm-up steps round(warmup_ratio · total_steps) and the decay steps max(total_steps, W + 1)
    (megatron's scheduler needs W < D).

    Raises:
        EngineError: total_steps < 1.
    """
    if total_steps < 1:
        raise EngineError(f"total_steps={total_steps}: expected >= 1 (the run's steps)")
    warmup = round(config.warmup_ratio * total_steps)
    return warmup, max(total_steps, warmup + 1)


def lr_factor(config: OptimizerConfig, total_steps: int, step: int) -> float:
    """f(step) of the module docstring (dimensionless; lr(step) = config.lr · f(step))."""
    warmup, decay = schedule_steps(config, total_steps)
    if warmup > 0 and step <= warmup:
        return step / warmup
    if config.schedule == "constant":
        return 1.0
    r = config.min_lr_ratio
    if step > decay:
        return r
    p = (step - warmup) / (decay - warmup)
    coeff = 0.5 * (1.0 + math.cos(math.pi * p)) if config.schedule == "cosine" else 1.0 - p
    return r + (1.0 - r) * coeff


def lr_scheduler(
    optimizer: torch.optim.Optimizer, config: OptimizerConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """The `OptimizerConfig` schedule for a torch optimizer (the torch engine's), stepped once per optimizer
    step: transformers' `cosine_with_min_lr` (cosine) and `constant_with_warmup` (constant), a LambdaLR of
    `lr_factor` (linear).

    Raises:
        EngineError: total_steps < 1.
    """
    from transformers import get_scheduler

    warmup, decay = schedule_steps(config, total_steps)
    if config.schedule == "cosine":
        return get_scheduler(
            "cosine_with_min_lr",
            optimizer,
            num_warmup_steps=warmup,
            num_training_steps=decay,
            scheduler_specific_kwargs={"min_lr_rate": config.min_lr_ratio},
        )
    if config.schedule == "linear":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, LinearLr(config, total_steps))
    return get_scheduler("constant_with_warmup", optimizer, num_warmup_steps=warmup)


class LinearLr:
    """`lr_factor` of a `linear` schedule as a picklable callable (LambdaLR's state_dict keeps its fields)."""

    def __init__(self, config: OptimizerConfig, total_steps: int) -> None:
        self.config, self.total_steps = config, total_steps

    def __call__(self, step: int) -> float:
        return lr_factor(self.config, self.total_steps, step)


def megatron_scheduler_args(config: OptimizerConfig, total_steps: int) -> dict[str, Any]:
    """The keyword arguments of megatron-core's `OptimizerParamScheduler` that run the schedule (module
    docstring); weight decay constant at `config.weight_decay` (times each parameter group's wd_mult)."""
    warmup, decay = schedule_steps(config, total_steps)
    min_lr = config.lr * (config.min_lr_ratio if config.schedule != "constant" else 1.0)
    return {
        "init_lr": 0.0 if warmup > 0 else config.lr,
        "max_lr": config.lr,
        "min_lr": min_lr,
        "lr_warmup_steps": warmup,
        "lr_decay_steps": decay,
        "lr_decay_style": config.schedule,
        "start_wd": config.weight_decay,
        "end_wd": config.weight_decay,
        "wd_incr_steps": decay,
        "wd_incr_style": "constant",
    }
