"""Residency by need (issue 21 item 4): which teachers leave their GPU between phases, decided from the memory
plan (`plan/memory_plan.py`) and the GPU's memory. A pure function: no torch, no device.

A teacher on a GPU is either resident (its weights stay through every phase of the step) or offloaded at the
drain and onloaded when scoring starts (the controller's DRAIN and TEACHER phases). Its scoring buffers are
released after each score either way (they are the plan's `teacher`-phase holding). Per teacher,
`models.teachers[].residency`:

- `always`: resident (the user's choice; `residency_warnings` says so when the plan does not fit with it);
- `never`: offloaded at every drain (the least memory between phases; every step pays one offload and one
  onload of the weights: 0.3 s for a 0.6B teacher on an H200, issue 21);
- `auto` (the default): resident when every GPU it is on still fits with it resident, else offloaded.

"Fits" on one GPU: for every phase of the plan (rollout, teacher, train), Σ over its children of what they hold
in that phase, a resident teacher's weights counted in every phase, plus `CUDA_CONTEXT_BYTES` per child, is at
most the GPU's memory. Under `auto` every teacher starts resident; then the one with the largest weights
leaves, one at a time, until the GPU fits (a GPU holds a few teachers: the greedy order is enough). A GPU whose memory is unknown (no `gpu_memory_gb`, nothing detected) keeps nothing
resident under `auto`, nor does a GPU with a child the plan could not size (a config.json not readable
here). A teacher over several GPUs (tensor parallel) is offloaded when any of them needs it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mopd_hpc.plan.memory_plan import (
    CUDA_CONTEXT_BYTES,
    GIB,
    PHASES,
    ChildMemory,
    ConfigReader,
    GpuMemory,
    memory_plan,
    read_model_config,
)
from mopd_hpc.runtime.plan import JobPlan

MODES = ("auto", "always", "never")


@dataclass(frozen=True, slots=True)
class ResidencyDecision:
    """`offload`: ids of the teachers offloaded at every drain (the others stay resident); `reasons`: one
    line per teacher on a GPU, why."""

    offload: frozenset[str]
    reasons: tuple[str, ...]

    @property
    def lines(self) -> list[str]:
        """`# ` lines for --dry-run."""
        return [f"# residency: {line}" for line in self.reasons]


def _weights(child: ChildMemory) -> int:
    held = child.holding("weights")
    return held.bytes if held is not None else 0


def gpu_bytes(gpu: GpuMemory, resident: frozenset[str]) -> tuple[int, str]:
    """(bytes, phase) of `gpu`'s largest phase with the teachers in `resident` kept on it (their weights in
    every phase, whatever phase the plan gave them) and the others' weights in `teacher` only, plus one CUDA
    context per child."""

    def in_phase(child: ChildMemory, phase: str) -> int:
        if child.teacher is None:
            return child.in_phase(phase)
        weights = child.holding("weights")
        rest = sum(h.bytes for h in child.holdings if h is not weights and h.phase in (None, phase))
        keep = child.teacher in resident or phase == "teacher"
        return rest + (_weights(child) if keep else 0)

    totals = {ph: sum(in_phase(c, ph) for c in gpu.children) for ph in PHASES}
    phase = max(PHASES, key=lambda ph: totals[ph])
    return totals[phase] + CUDA_CONTEXT_BYTES * len(gpu.children), phase


def decide_residency(gpus: tuple[GpuMemory, ...], modes: Mapping[str, str]) -> ResidencyDecision:
    """The teachers to offload between phases (module docstring's rule).

    Args:
        gpus: the memory plan (`memory_plan(..., capacity_gib=...)`; each GPU's `capacity_gib` is its memory,
            None when unknown).
        modes: teacher id → 'auto' | 'always' | 'never'; a teacher absent from it is 'auto'.

    Raises:
        ValueError: a mode outside MODES (named with its teacher).
    """
    for tid, mode in modes.items():
        if mode not in MODES:
            raise ValueError(f"teacher {tid!r}: residency {mode!r}; expected one of {MODES}")
    offload: set[str] = set()
    reasons: dict[str, str] = {}
    for gpu in gpus:
        where = f"node {gpu.node} GPU {gpu.gpu}"
        teachers = [c for c in gpu.children if c.teacher is not None]
        for child in teachers:
            mode = modes.get(child.teacher, "auto")
            if mode != "auto":
                reasons.setdefault(child.teacher, f"teacher {child.teacher}: residency {mode}")
                if mode == "never":
                    offload.add(child.teacher)
        auto = [c for c in teachers if modes.get(c.teacher, "auto") == "auto"]
        if not auto:
            continue
        unknown = (
            f"its memory is unknown; set cluster.{gpu.group}.gpu_memory_gb"
            if gpu.capacity_gib is None
            else next((f"{c.label} is not planned ({c.note})" for c in gpu.children if not c.holdings), None)
        )
        if unknown is not None:
            for child in auto:
                offload.add(child.teacher)
                reasons[child.teacher] = (
                    f"teacher {child.teacher}: offloaded between phases ({where}: {unknown})"
                )
            continue
        capacity = int(gpu.capacity_gib * GIB)
        kept = {c.teacher for c in teachers} - offload
        for child in sorted(auto, key=_weights, reverse=True):
            need, phase = gpu_bytes(gpu, frozenset(kept))
            if need <= capacity:
                break
            kept.discard(child.teacher)
            offload.add(child.teacher)
            reasons[child.teacher] = (
                f"teacher {child.teacher}: offloaded between phases ({where}: {need / GIB:.1f} GiB in the {phase} "
                f"phase with it resident, more than {gpu.capacity_gib:g} GiB)"
            )
        need, phase = gpu_bytes(gpu, frozenset(kept))
        for child in auto:
            if child.teacher not in offload:
                reasons.setdefault(
                    child.teacher,
                    f"teacher {child.teacher}: resident ({where}: {need / GIB:.1f} GiB at most, in the {phase} "
                    f"phase, of {gpu.capacity_gib:g} GiB)",
                )
    # A teacher offloaded on one of its GPUs is offloaded: its reason is the offloading GPU's.
    return ResidencyDecision(frozenset(offload), tuple(reasons[t] for t in sorted(reasons)))


def residency_warnings(gpus: tuple[GpuMemory, ...], modes: Mapping[str, str]) -> list[str]:
    """One line per GPU that does not fit with its `always` teachers resident (the others as decided)."""
    decision = decide_residency(gpus, modes)
    out = []
    for gpu in gpus:
        if gpu.capacity_gib is None:
            continue
        always = [c.teacher for c in gpu.children if c.teacher and modes.get(c.teacher) == "always"]
        kept = frozenset(c.teacher for c in gpu.children if c.teacher and c.teacher not in decision.offload)
        need, phase = gpu_bytes(gpu, kept)
        if always and need > gpu.capacity_gib * GIB:
            out.append(
                f"models.teachers[].residency: always for {', '.join(always)} on node {gpu.node} GPU {gpu.gpu}: "
                f"{need / GIB:.1f} GiB in the {phase} phase, more than {gpu.capacity_gib:g} GiB; expected it to "
                "fit: set residency auto (offloaded when it must leave)"
            )
    return out


def residency_modes(cfg: Any) -> dict[str, str]:
    """teacher id → its `models.teachers[].residency`."""
    return {t.id: t.residency for t in cfg.models.teachers}


def planned_residency(
    cfg: Any, plan: JobPlan, read: ConfigReader = read_model_config, capacity_gib: float | None = None
) -> tuple[ResidencyDecision, tuple[GpuMemory, ...]]:
    """The decision for `cfg`'s job `plan` and the memory plan it leads to: decided from the plan with every
    teacher but the `never` ones resident (the actor's derived micro-batch budget then leaves room for them),
    then planned again with the teachers that stay. `capacity_gib`: one GPU's memory where a group has no
    `gpu_memory_gb` (what the job detected)."""
    modes = residency_modes(cfg)
    candidates = frozenset(t for t, mode in modes.items() if mode != "never")
    first = memory_plan(cfg, plan, read, capacity_gib=capacity_gib, resident_teachers=candidates)
    decision = decide_residency(first, modes)
    final = memory_plan(
        cfg, plan, read, capacity_gib=capacity_gib, resident_teachers=candidates - decision.offload
    )
    return decision, final
