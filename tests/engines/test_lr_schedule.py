"""The actor's lr schedule (engines/lr_schedule.py; issue 31 item 5): megatron-core's own
`OptimizerParamScheduler`, built from `megatron_scheduler_args` as the megatron engine builds it, gives at
every step of a run the lr of the schedule's definition (`lr_factor`), and so does the torch engine's
transformers schedule; a few steps are checked against values worked out by hand. A scheduler rebuilt from
another's state_dict (a resume) goes on at the same lr. CPU: the scheduler needs only an optimizer's
param_groups (a torch AdamW over one tensor here).
"""

from __future__ import annotations

import math

import pytest
import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from mopd_hpc.config.models import OptimizerConfig
from mopd_hpc.engines.lr_schedule import lr_factor, lr_scheduler, megatron_scheduler_args

TOTAL = 20
LR = 1.0e-3


def adamw() -> torch.optim.AdamW:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=LR)


def megatron_lrs(config: OptimizerConfig, total: int) -> list[float]:
    """The lr of each step 0..total-1 (the lr step s + 1 trains at) from megatron-core's scheduler."""
    optimizer = adamw()
    scheduler = OptimizerParamScheduler(optimizer, **megatron_scheduler_args(config, total))
    out = []
    for _ in range(total):
        out.append(optimizer.param_groups[0]["lr"])
        scheduler.step(1)
    return out


def torch_lrs(config: OptimizerConfig, total: int) -> list[float]:
    optimizer = adamw()
    scheduler = lr_scheduler(optimizer, config, total)
    out = []
    for _ in range(total):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear"])
@pytest.mark.parametrize("warmup_ratio", [0.0, 0.1, 0.25])
def test_megatron_scheduler_and_torch_schedule_agree_with_the_definition(
    schedule: str, warmup_ratio: float
) -> None:
    config = OptimizerConfig(lr=LR, schedule=schedule, warmup_ratio=warmup_ratio, min_lr_ratio=0.1)
    want = [LR * lr_factor(config, TOTAL, s) for s in range(TOTAL)]
    assert megatron_lrs(config, TOTAL) == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert torch_lrs(config, TOTAL) == pytest.approx(want, rel=1e-9, abs=1e-15)


def test_values_at_a_few_steps_by_hand() -> None:
    """total 20, warmup 0.1 (W = 2), min_lr_ratio 0.1, decay steps D = 20: p = (s − 2)/18."""
    cosine = megatron_lrs(
        OptimizerConfig(lr=LR, schedule="cosine", warmup_ratio=0.1, min_lr_ratio=0.1), TOTAL
    )
    linear = megatron_lrs(
        OptimizerConfig(lr=LR, schedule="linear", warmup_ratio=0.1, min_lr_ratio=0.1), TOTAL
    )
    constant = megatron_lrs(OptimizerConfig(lr=LR, schedule="constant", warmup_ratio=0.1), TOTAL)
    assert cosine[0] == 0.0 and cosine[1] == pytest.approx(5.0e-4) and cosine[2] == pytest.approx(LR)
    assert cosine[11] == pytest.approx(
        1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 0.5))
    )  # 5.5e-4, mid-decay
    assert cosine[19] == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 17 / 18)))
    assert linear[11] == pytest.approx(5.5e-4) and linear[19] == pytest.approx(1e-4 + 0.9e-3 / 18)
    assert constant[:3] == pytest.approx([0.0, 5.0e-4, LR]) and set(constant[2:]) == {LR}
    assert megatron_lrs(OptimizerConfig(lr=LR), TOTAL) == [LR] * TOTAL  # the default: constant, no warm-up


def test_a_resumed_scheduler_goes_on_at_the_same_lr() -> None:
    config = OptimizerConfig(lr=LR, schedule="cosine", warmup_ratio=0.1, min_lr_ratio=0.1)
    args = megatron_scheduler_args(config, TOTAL)
    first, second = adamw(), adamw()
    before = OptimizerParamScheduler(first, **args)
    before.step(7)
    after = OptimizerParamScheduler(second, **args)  # a fresh engine, then the checkpoint's state
    after.load_state_dict(before.state_dict())
    assert (
        second.param_groups[0]["lr"]
        == first.param_groups[0]["lr"]
        == pytest.approx(LR * lr_factor(config, TOTAL, 7))
    )
    before.step(1)
    after.step(1)
    assert second.param_groups[0]["lr"] == first.param_groups[0]["lr"]


def test_a_warmup_as_long_as_the_run_still_builds() -> None:
    """warmup_ratio 0.95 of 10 steps rounds to W = 10 = total: the decay steps become W + 1 (megatron's
    scheduler needs W < D), the warm-up ends at the last step."""
    config = OptimizerConfig(lr=LR, schedule="linear", warmup_ratio=0.95)
    assert megatron_lrs(config, 10) == pytest.approx([LR * s / 10 for s in range(10)])
