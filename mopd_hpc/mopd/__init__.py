"""MOPD algorithm core: targets, losses, token log-probs, routing, plan, phases, compatibility.

See DESIGN.md §3 for the formulas and their sources; each module's docstring gives its own.
"""

from __future__ import annotations

from mopd_hpc.mopd.compose import CompositionError, compose_advantages, compose_loss
from mopd_hpc.mopd.grpo import grpo_advantages, grpo_policy_loss
from mopd_hpc.mopd.logprobs import LogprobError, token_logprobs
from mopd_hpc.mopd.loss import mopd_loss
from mopd_hpc.mopd.normalize import LossInputError, loss_denominator, normalize
from mopd_hpc.mopd.objective import Objective, ObjectiveError
from mopd_hpc.mopd.phases import DrainReceipt, Phase, PhaseMachine
from mopd_hpc.mopd.plan import ExecutionPlan, PlanError
from mopd_hpc.mopd.routing import RoutedDataset, RoutedSample, RoutedSource, RoutingError
from mopd_hpc.mopd.targets import TargetError, TeacherTargets, aggregate_teacher_targets
from mopd_hpc.mopd.topk import TeacherTopK, topk_reverse_kl_loss

__all__ = [
    "CompositionError",
    "DrainReceipt",
    "ExecutionPlan",
    "LogprobError",
    "LossInputError",
    "Objective",
    "ObjectiveError",
    "Phase",
    "PhaseMachine",
    "PlanError",
    "RoutedDataset",
    "RoutedSample",
    "RoutedSource",
    "RoutingError",
    "TargetError",
    "TeacherTargets",
    "TeacherTopK",
    "aggregate_teacher_targets",
    "compose_advantages",
    "compose_loss",
    "grpo_advantages",
    "grpo_policy_loss",
    "loss_denominator",
    "mopd_loss",
    "normalize",
    "token_logprobs",
    "topk_reverse_kl_loss",
]
