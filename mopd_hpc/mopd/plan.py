"""ExecutionPlan: what a run needs, derived once from the loss config before any process starts.

Rules (DESIGN.md §3):
- c_d = 0 ⇒ no teacher is loaded, scored or drained; the step goes ROLLOUT → TRAIN directly.
- c_rl = 0 and α = 0 ⇒ no RL advantage work and no reference model (rewards are still computed,
  cheaply, for monitoring: `requires_reward` says whether the *loss* needs them).
- A reference model is needed only for a KL penalty inside the RL term (c_rl > 0 and β > 0); it scores the
  rollouts in the TEACHER phase (with the teachers, or alone when c_d = 0), and its device memory is released
  before the drain receipts, like the teachers' tensors (`engines/reference.py`).
- α only acts through the distillation advantage, so it needs rewards only when c_d > 0.
Both coefficients zero is rejected by `LossConfig` already.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from mopd_hpc.config.loss import LossConfig


class Phase(enum.Enum):
    """The phases of a step (`step_phases`); the phase machine (`mopd/phases.py`) orders them."""

    ROLLOUT = "rollout"
    TEACHER = "teacher"
    DRAIN = "drain"
    TRAIN = "train"
    SYNC = "sync"
    ABORT = "abort"


class PlanError(ValueError):
    """The config asks for work the plan cannot carry out (e.g. distillation without teachers)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecutionPlan:
    """Frozen record of the work a step does. Build it with `ExecutionPlan.from_config`.

    Attributes:
        requires_teacher_scoring: teachers are loaded and score the rollouts (c_d > 0).
        requires_rl: the GRPO policy loss L_RL is computed (c_rl > 0).
        requires_reference: a reference model scores the rollouts (c_rl > 0 and kl_coefficient > 0).
        requires_reward: the loss uses rewards (c_rl > 0, or α > 0 with c_d > 0).
        estimator: "sampled" or "topk" (what teachers return: token log-probs or top-k).
        teachers: the teacher ids to load, in config order; () when no teacher is scored.
    """

    requires_teacher_scoring: bool
    requires_rl: bool
    requires_reference: bool
    requires_reward: bool
    estimator: str
    teachers: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.requires_teacher_scoring != bool(self.teachers):
            raise PlanError(
                f"requires_teacher_scoring={self.requires_teacher_scoring} but teachers={self.teachers}; "
                "teachers are listed exactly when they are scored"
            )
        if self.requires_reference and not self.requires_rl:
            raise PlanError("requires_reference without requires_rl: the reference KL lives in the RL term")

    @classmethod
    def from_config(cls, loss: LossConfig, *, teachers: Sequence[str]) -> ExecutionPlan:
        """Derive the plan from the `loss:` section and the configured teacher ids.

        Raises:
            PlanError: distillation_coefficient > 0 with no teacher, or duplicate teacher ids.
        """
        if len(set(teachers)) != len(teachers):
            raise PlanError(f"teachers {list(teachers)} repeat an id; expected unique ids")
        distill = loss.distillation_coefficient > 0
        rl = loss.rl_coefficient > 0
        if distill and not teachers:
            raise PlanError(
                f"distillation_coefficient is {loss.distillation_coefficient} but no teacher is configured; "
                "add a teacher or set distillation_coefficient to 0"
            )
        return cls(
            requires_teacher_scoring=distill,
            requires_rl=rl,
            requires_reference=rl and loss.kl_coefficient > 0,
            requires_reward=rl or (distill and loss.orm_alpha > 0),
            estimator=loss.estimator,
            teachers=tuple(teachers) if distill else (),
        )

    @property
    def scores_before_train(self) -> bool:
        """The step has TEACHER and DRAIN phases: teachers or the reference model score the rollouts."""
        return self.requires_teacher_scoring or self.requires_reference

    @property
    def step_phases(self) -> tuple[Phase, ...]:
        """The phases of one step, in order (SYNC then back to ROLLOUT)."""
        if self.scores_before_train:
            return (Phase.ROLLOUT, Phase.TEACHER, Phase.DRAIN, Phase.TRAIN, Phase.SYNC)
        return (Phase.ROLLOUT, Phase.TRAIN, Phase.SYNC)
