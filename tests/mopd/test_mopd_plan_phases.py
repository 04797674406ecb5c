"""ExecutionPlan derivation and the per-step phase machine."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mopd_hpc.config.loss import LossConfig
from mopd_hpc.mopd.phases import (
    DrainIncompleteError,
    DrainReceipt,
    Phase,
    PhaseError,
    PhaseMachine,
    PhaseTransitionError,
    Transition,
)
from mopd_hpc.mopd.plan import ExecutionPlan, PlanError


def test_pure_distillation_plan() -> None:
    plan = ExecutionPlan.from_config(LossConfig(), teachers=["math", "code"])
    assert (
        plan.requires_teacher_scoring,
        plan.requires_rl,
        plan.requires_reference,
        plan.requires_reward,
    ) == (
        True,
        False,
        False,
        False,
    )
    assert plan.teachers == ("math", "code")
    assert plan.step_phases == (Phase.ROLLOUT, Phase.TEACHER, Phase.DRAIN, Phase.TRAIN, Phase.SYNC)


def test_zero_distillation_loads_no_teacher() -> None:
    loss = LossConfig(distillation_coefficient=0.0, rl_coefficient=1.0, kl_coefficient=0.05, orm_alpha=0.3)
    plan = ExecutionPlan.from_config(loss, teachers=["math"])
    assert plan.requires_teacher_scoring is False
    assert plan.teachers == ()  # configured, never loaded, scored or drained
    assert plan.requires_rl and plan.requires_reference and plan.requires_reward
    # no teacher, but the reference model scores the rollouts in TEACHER and is drained (engines/reference.py)
    assert plan.step_phases == (Phase.ROLLOUT, Phase.TEACHER, Phase.DRAIN, Phase.TRAIN, Phase.SYNC)
    no_kl = ExecutionPlan.from_config(loss.model_copy(update={"kl_coefficient": 0.0}), teachers=["math"])
    assert not no_kl.requires_reference and no_kl.step_phases == (Phase.ROLLOUT, Phase.TRAIN, Phase.SYNC)


def test_orm_alpha_needs_rewards_only_with_distillation() -> None:
    plan = ExecutionPlan.from_config(LossConfig(orm_alpha=0.5), teachers=["t"])
    assert plan.requires_reward and not plan.requires_rl and not plan.requires_reference


def test_kl_coefficient_without_rl_needs_no_reference() -> None:
    plan = ExecutionPlan.from_config(LossConfig(kl_coefficient=0.1), teachers=["t"])
    assert not plan.requires_reference


def test_plan_errors_and_frozen() -> None:
    with pytest.raises(PlanError, match="no teacher is configured"):
        ExecutionPlan.from_config(LossConfig(), teachers=[])
    with pytest.raises(PlanError, match="repeat an id"):
        ExecutionPlan.from_config(LossConfig(), teachers=["a", "a"])
    plan = ExecutionPlan.from_config(LossConfig(), teachers=["a"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.requires_rl = True  # type: ignore[misc]
    assert not hasattr(plan, "__dict__")  # slots


def run_step(machine: PhaseMachine, consumers: list[str]) -> None:
    machine.transition(Phase.TEACHER)
    machine.transition(Phase.DRAIN)
    for c in consumers:
        machine.receive(DrainReceipt(consumer=c, step=machine.step))
    machine.release_teacher()
    machine.transition(Phase.TRAIN)
    machine.transition(Phase.SYNC)
    machine.transition(Phase.ROLLOUT)


def test_full_cycle_with_teacher_and_event_seam() -> None:
    events: list[Transition] = []
    plan = ExecutionPlan.from_config(LossConfig(), teachers=["t"])
    machine = PhaseMachine.from_plan(plan, consumers=["actor", "critic"], on_transition=events.append)
    run_step(machine, ["actor", "critic"])
    run_step(machine, ["critic", "actor"])
    assert machine.step == 2 and machine.phase is Phase.ROLLOUT
    assert [(e.source, e.target) for e in events[:5]] == [
        (Phase.ROLLOUT, Phase.TEACHER),
        (Phase.TEACHER, Phase.DRAIN),
        (Phase.DRAIN, Phase.TRAIN),
        (Phase.TRAIN, Phase.SYNC),
        (Phase.SYNC, Phase.ROLLOUT),
    ]


def test_release_requires_every_receipt() -> None:
    machine = PhaseMachine(uses_teacher=True, consumers=["actor", "critic"])
    machine.transition(Phase.TEACHER)
    machine.transition(Phase.DRAIN)
    machine.receive(DrainReceipt(consumer="actor", step=0))
    with pytest.raises(DrainIncompleteError, match=r"before drain receipts from \['critic'\]"):
        machine.release_teacher()
    with pytest.raises(DrainIncompleteError, match="DRAIN -> TRAIN before the teacher was released"):
        machine.transition(Phase.TRAIN)
    with pytest.raises(PhaseError, match="for step 3; expected step 0"):
        machine.receive(DrainReceipt(consumer="critic", step=3))
    with pytest.raises(PhaseError, match="unknown consumer 'rollout'"):
        machine.receive(DrainReceipt(consumer="rollout", step=0))
    machine.receive(DrainReceipt(consumer="critic", step=0))
    assert [r.consumer for r in machine.release_teacher()] == ["actor", "critic"]
    machine.transition(Phase.TRAIN)


def test_no_teacher_plan_goes_rollout_to_train() -> None:
    loss = LossConfig(distillation_coefficient=0.0, rl_coefficient=1.0)
    machine = PhaseMachine.from_plan(ExecutionPlan.from_config(loss, teachers=[]), consumers=["actor"])
    with pytest.raises(PhaseTransitionError, match="ROLLOUT -> TEACHER"):
        machine.transition(Phase.TEACHER)
    machine.transition(Phase.TRAIN)
    machine.transition(Phase.SYNC)
    machine.transition(Phase.ROLLOUT)
    assert machine.step == 1


@settings(max_examples=60, deadline=None)
@given(
    uses_teacher=st.booleans(),
    walk=st.lists(st.sampled_from(list(Phase)), max_size=12),
)
def test_illegal_transitions_raise_naming_both_states(uses_teacher, walk) -> None:
    allowed_with = {
        (Phase.ROLLOUT, Phase.TEACHER),
        (Phase.TEACHER, Phase.DRAIN),
        (Phase.DRAIN, Phase.TRAIN),
        (Phase.TRAIN, Phase.SYNC),
        (Phase.SYNC, Phase.ROLLOUT),
        (Phase.ABORT, Phase.ROLLOUT),
    }
    allowed_without = {
        (Phase.ROLLOUT, Phase.TRAIN),
        (Phase.TRAIN, Phase.SYNC),
        (Phase.SYNC, Phase.ROLLOUT),
        (Phase.ABORT, Phase.ROLLOUT),
    }
    allowed = allowed_with if uses_teacher else allowed_without
    machine = PhaseMachine(uses_teacher=uses_teacher, consumers=["actor"])
    for target in walk:
        source = machine.phase
        if source is Phase.DRAIN and target is Phase.TRAIN:
            machine.receive(DrainReceipt(consumer="actor", step=machine.step))
            machine.release_teacher()
        if target is Phase.ABORT or (source, target) in allowed:
            machine.transition(target)
            assert machine.phase is target
        else:
            with pytest.raises(PhaseTransitionError) as info:
                machine.transition(target)
            assert f"{source.name} -> {target.name}" in str(info.value)
            assert machine.phase is source


def test_abort_resets_the_drain_state() -> None:
    machine = PhaseMachine(uses_teacher=True, consumers=["actor"])
    machine.transition(Phase.TEACHER)
    machine.transition(Phase.DRAIN)
    machine.receive(DrainReceipt(consumer="actor", step=0))
    machine.transition(Phase.ABORT)
    machine.transition(Phase.ROLLOUT)
    assert machine.step == 0 and machine.pending_consumers == {"actor"}
    with pytest.raises(PhaseTransitionError, match="ROLLOUT -> DRAIN"):
        machine.transition(Phase.DRAIN)
