"""Which steps of the run write a metrics line, a checkpoint, an evaluation point and an export (the
controller's clock, `trainer/controller.py`).

    metrics_due(step, cfg)      step % log_interval == 0, or the last step, or an evaluation step
    checkpoint_due(step, cfg)   step % checkpoint_interval == 0, or the last step
    eval_due(step, cfg)         data.eval.interval > 0 (and data.eval.size > 0): step % interval == 0, or the last
    export_due(step, cfg)       export.interval > 0: step % interval == 0, or the last step

Steps are 1-based (step s is the s-th optimizer step); the last step (`cfg.steps`) always writes a metrics line
and a checkpoint, so a run's final metrics line and checkpoint exist whatever the intervals; an evaluation step
always writes its metrics line (the point's keys are on it).
"""

from __future__ import annotations

from typing import Any


def _due(step: int, interval: int, last: int) -> bool:
    return interval > 0 and (step % interval == 0 or step == last)


def eval_due(step: int, cfg: Any) -> bool:
    """Whether step `step` (1-based) takes an evaluation point during training (`trainer/evaluator.py`)."""
    return cfg.data.eval.size > 0 and _due(step, cfg.data.eval.interval, cfg.steps)


def export_due(step: int, cfg: Any) -> bool:
    """Whether step `step` (1-based) writes a Hugging Face export (`trainer/exports.py`)."""
    return _due(step, cfg.export.interval, cfg.steps)


def metrics_due(step: int, cfg: Any) -> bool:
    """Whether step `step` (1-based) writes a metrics line: every `log_interval` steps, at the last, and at an
    evaluation step."""
    return step % cfg.log_interval == 0 or step == cfg.steps or eval_due(step, cfg)


def checkpoint_due(step: int, cfg: Any) -> bool:
    """Whether step `step` (1-based) writes a checkpoint: every `checkpoint_interval` steps and at the last."""
    return step % cfg.checkpoint_interval == 0 or step == cfg.steps
