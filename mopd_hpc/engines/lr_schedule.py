"""The actor's learning-rate schedule (`OptimizerConfig.schedule`), built on transformers' schedules.

lr(s) = lr · f(s) for optimizer step s = 0, 1, ...: a linear warm-up f = s / W over the first
W = round(warmup_ratio · total_steps) steps, then `constant` (f = 1) or `cosine`
(f = r + (1 − r) · ½(1 + cos(π · (s − W) / (total_steps − W))), r = min_lr_ratio; transformers'
`cosine_with_min_lr`). The scheduler's state travels in the engine's checkpoint, so a resumed run continues
the schedule where it stopped.
"""

from __future__ import annotations

import torch

from mopd_hpc.config.models import OptimizerConfig
from mopd_hpc.engines.protocol import EngineError


def lr_scheduler(
    optimizer: torch.optim.Optimizer, config: OptimizerConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """The `OptimizerConfig` schedule as transformers' LambdaLR: a linear warm-up over
    round(warmup_ratio·total_steps) steps, then constant, or cosine to min_lr_ratio·lr just after
    `total_steps`; stepped once per optimizer step.

    Raises:
        EngineError: total_steps < 1.
    """
    from transformers import get_scheduler

    if total_steps < 1:
        raise EngineError(f"total_steps={total_steps}: expected >= 1 (the run's steps)")
    warmup = round(config.warmup_ratio * total_steps)
    if config.schedule == "cosine":
        return get_scheduler(
            "cosine_with_min_lr",
            optimizer,
            num_warmup_steps=warmup,
            num_training_steps=total_steps,
            scheduler_specific_kwargs={"min_lr_rate": config.min_lr_ratio},
        )
    return get_scheduler("constant_with_warmup", optimizer, num_warmup_steps=warmup)
