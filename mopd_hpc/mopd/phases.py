"""The per-step phase machine: who owns the GPUs when, and when teacher memory may be released.

    ROLLOUT → TEACHER → DRAIN → TRAIN → SYNC → ROLLOUT      (a plan with teachers or a reference model)
    ROLLOUT → TRAIN → SYNC → ROLLOUT                        (neither: c_d = 0 and no KL penalty)
    any phase → ABORT → ROLLOUT                             (failure; ABORT is idempotent)

Teacher resources may be released only after a drain receipt from every registered consumer (each
process holding teacher tensors acknowledges it has cleared them), and the step may leave DRAIN only
after that release — the invariant AReaL's `DrainReceipt` / `PersistentTeacherManager.release` enforce.
An illegal transition raises `PhaseTransitionError` naming both states.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from mopd_hpc.mopd.plan import ExecutionPlan, Phase


class PhaseError(ValueError):
    """Base of the phase machine's errors."""


class PhaseTransitionError(PhaseError):
    """A transition the machine does not allow from its current phase."""


class DrainIncompleteError(PhaseError):
    """Teacher release (or leaving DRAIN) before every consumer sent its drain receipt."""


_WITH_TEACHER = {
    Phase.ROLLOUT: {Phase.TEACHER},
    Phase.TEACHER: {Phase.DRAIN},
    Phase.DRAIN: {Phase.TRAIN},
    Phase.TRAIN: {Phase.SYNC},
    Phase.SYNC: {Phase.ROLLOUT},
    Phase.ABORT: {Phase.ROLLOUT},
}
_WITHOUT_TEACHER = {
    Phase.ROLLOUT: {Phase.TRAIN},
    Phase.TRAIN: {Phase.SYNC},
    Phase.SYNC: {Phase.ROLLOUT},
    Phase.ABORT: {Phase.ROLLOUT},
}


@dataclass(frozen=True, slots=True)
class DrainReceipt:
    """A consumer's acknowledgement that it holds no teacher tensor of `step` any more."""

    consumer: str
    step: int
    buffers_cleared: int = 0


@dataclass(frozen=True, slots=True)
class Transition:
    """One phase change, as reported to the `on_transition` callback (for event logs)."""

    step: int
    source: Phase
    target: Phase


class PhaseMachine:
    """The phase machine of one run; starts in ROLLOUT at step 0.

    Args:
        uses_teacher: the plan scores teachers (`ExecutionPlan.requires_teacher_scoring`).
        consumers: names of the processes that must send a drain receipt each step (e.g. "actor").
        on_transition: called after every transition (a seam for event logging and tests).

    Raises:
        PhaseError: uses_teacher with no consumer, or a repeated consumer name.
    """

    def __init__(
        self,
        *,
        uses_teacher: bool,
        consumers: Iterable[str] = (),
        on_transition: Callable[[Transition], None] | None = None,
    ) -> None:
        names = list(consumers)
        if len(set(names)) != len(names):
            raise PhaseError(f"consumers {names} repeat a name; expected unique names")
        if uses_teacher and not names:
            raise PhaseError("uses_teacher=True needs at least one drain consumer (e.g. 'actor')")
        self._table = _WITH_TEACHER if uses_teacher else _WITHOUT_TEACHER
        self._uses_teacher = uses_teacher
        self._consumers = frozenset(names)
        self._receipts: dict[str, DrainReceipt] = {}
        self._teacher_released = False
        self._on_transition = on_transition
        self.phase = Phase.ROLLOUT
        self.step = 0

    @classmethod
    def from_plan(
        cls,
        plan: ExecutionPlan,
        *,
        consumers: Iterable[str],
        on_transition: Callable[[Transition], None] | None = None,
    ) -> PhaseMachine:
        """The machine for `plan` (TEACHER and DRAIN exactly when teachers or the reference model score the
        rollouts: `ExecutionPlan.scores_before_train`)."""
        scores = plan.scores_before_train
        names = tuple(consumers) if scores else ()
        return cls(uses_teacher=scores, consumers=names, on_transition=on_transition)

    @property
    def pending_consumers(self) -> frozenset[str]:
        """Consumers whose drain receipt for this step has not arrived."""
        return self._consumers - self._receipts.keys()

    @property
    def teacher_released(self) -> bool:
        return self._teacher_released

    def transition(self, target: Phase) -> None:
        """Move to `target`.

        Raises:
            PhaseTransitionError: `target` is not allowed from the current phase (both are named).
            DrainIncompleteError: leaving DRAIN before the teacher was released.
        """
        allowed = target is Phase.ABORT or target in self._table.get(self.phase, set())
        if not allowed:
            mode = "with teachers" if self._uses_teacher else "without teachers"
            raise PhaseTransitionError(
                f"illegal phase transition {self.phase.name} -> {target.name} (plan {mode}); from "
                f"{self.phase.name} allowed: {sorted(p.name for p in self._table.get(self.phase, ()))} or ABORT"
            )
        if self.phase is Phase.DRAIN and target is Phase.TRAIN and not self._teacher_released:
            raise DrainIncompleteError(
                f"DRAIN -> TRAIN before the teacher was released; pending receipts: {sorted(self.pending_consumers)}"
            )
        source = self.phase
        self.phase = target
        if target is Phase.TEACHER or target is Phase.ABORT:
            self._receipts.clear()
            self._teacher_released = False
        if source is Phase.SYNC and target is Phase.ROLLOUT:
            self.step += 1
        if self._on_transition is not None:
            self._on_transition(Transition(step=self.step, source=source, target=target))

    def receive(self, receipt: DrainReceipt) -> None:
        """Record a consumer's drain receipt (in DRAIN only, for the current step, idempotent).

        Raises:
            PhaseError: not in DRAIN, unknown consumer, or a receipt for another step.
        """
        if self.phase is not Phase.DRAIN:
            raise PhaseError(
                f"drain receipt from {receipt.consumer!r} in phase {self.phase.name}; expected DRAIN"
            )
        if receipt.consumer not in self._consumers:
            raise PhaseError(
                f"drain receipt from unknown consumer {receipt.consumer!r}; registered: {sorted(self._consumers)}"
            )
        if receipt.step != self.step:
            raise PhaseError(
                f"drain receipt from {receipt.consumer!r} for step {receipt.step}; expected step {self.step}"
            )
        self._receipts[receipt.consumer] = receipt

    def release_teacher(self) -> tuple[DrainReceipt, ...]:
        """Allow teacher memory to be released; returns the receipts that justify it.

        Raises:
            DrainIncompleteError: not in DRAIN, or a consumer's receipt is missing (named).
        """
        if self.phase is not Phase.DRAIN:
            raise DrainIncompleteError(f"teacher release in phase {self.phase.name}; expected DRAIN")
        if self.pending_consumers:
            raise DrainIncompleteError(
                f"teacher release at step {self.step} before drain receipts from {sorted(self.pending_consumers)}"
            )
        self._teacher_released = True
        return tuple(self._receipts[c] for c in sorted(self._consumers))
