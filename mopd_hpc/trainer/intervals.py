"""Which steps of the run write a metrics line and a checkpoint (the controller's clock, `trainer/controller.py`).

    metrics_due(step, cfg)      step % log_interval == 0, or the last step
    checkpoint_due(step, cfg)   step % checkpoint_interval == 0, or the last step

Steps are 1-based (step s is the s-th optimizer step); the last step (`cfg.steps`) always writes both, so a
run's final metrics line and checkpoint exist whatever the intervals.
"""

from __future__ import annotations

from typing import Any


def metrics_due(step: int, cfg: Any) -> bool:
    """Whether step `step` (1-based) writes a metrics line: every `log_interval` steps and at the last."""
    return step % cfg.log_interval == 0 or step == cfg.steps


def checkpoint_due(step: int, cfg: Any) -> bool:
    """Whether step `step` (1-based) writes a checkpoint: every `checkpoint_interval` steps and at the last."""
    return step % cfg.checkpoint_interval == 0 or step == cfg.steps
