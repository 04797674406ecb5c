"""Residency by need (`plan/residency_plan.py`): which teachers leave the GPU between phases, decided from
the memory plan and the GPU's memory — from plans of configs/local_gpu_colocated.yaml (Qwen3-0.6B shapes) and
from hand-made plans; the controller offloads exactly the decided teachers at the drain.
"""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import pytest
from helpers_models import QWEN3_0_6B

from mopd_hpc.config import load_run_config
from mopd_hpc.plan import memory_plan as mp
from mopd_hpc.plan import residency_plan as rp
from mopd_hpc.plan.placement import place_children

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "local_gpu_colocated_awex.yaml"
OOM = ["data.batch_size=64", "rollout.sampling.max_new_tokens=256", "models.actor.micro_batch_tokens=16384"]
GIB = 2**30


def decided(sets: list[str], capacity: float | None = None):
    cfg = load_run_config(str(CONFIG), sets, False)
    return rp.planned_residency(cfg, place_children(cfg), lambda path: QWEN3_0_6B, capacity_gib=capacity)


def test_a_teacher_that_fits_stays_resident_on_an_h200() -> None:
    decision, (gpu,) = decided(OOM, 139.8)
    assert decision.offload == frozenset()
    (reason,) = decision.reasons
    assert reason.startswith("teacher teacher: resident (node 0 GPU 0: ") and "of 139.8 GiB)" in reason
    weights = gpu.children[1].holding("weights")
    assert weights is not None and weights.phase is None  # the final plan holds it in every phase
    need, phase = rp.gpu_bytes(gpu, frozenset({"teacher"}))
    assert need == gpu.peak()[0] + 3 * mp.CUDA_CONTEXT_BYTES and phase == gpu.peak()[1] == "train"
    assert decision.lines == [f"# residency: {reason}"]


def test_a_teacher_that_does_not_fit_beside_the_train_phase_is_offloaded() -> None:
    """The GPU's memory between the plan's peak without the teacher's weights and with them: offloaded; its
    final plan holds the weights in the teacher phase only, and that plan fits."""
    _, (resident,) = decided(OOM, 139.8)
    with_teacher, _ = rp.gpu_bytes(resident, frozenset({"teacher"}))
    without, _ = rp.gpu_bytes(resident, frozenset())
    weights = resident.children[1].holding("weights").bytes
    assert with_teacher - without == weights  # the train phase is the largest either way
    capacity = (without + weights / 2) / GIB
    sets = [*OOM, f"cluster.group.gpu_memory_gb={capacity}"]
    decision, (gpu,) = decided(sets)
    assert decision.offload == {"teacher"}
    (reason,) = decision.reasons
    assert (
        f"{with_teacher / GIB:.1f} GiB in the train phase with it resident, more than {capacity:g} GiB"
        in reason
    )
    assert gpu.children[1].holding("weights").phase == "teacher"
    assert rp.gpu_bytes(gpu, frozenset())[0] <= capacity * GIB
    # 'always' keeps it anyway, and the check says so; 'never' offloads it on any GPU.
    always, _ = decided([*sets, "models.teachers.0.residency=always"])
    assert always.offload == frozenset() and always.reasons == ("teacher teacher: residency always",)
    cfg = load_run_config(str(CONFIG), [*sets, "models.teachers.0.residency=always"], False)
    gpus = mp.memory_plan(
        cfg, place_children(cfg), lambda path: QWEN3_0_6B, resident_teachers=frozenset({"teacher"})
    )
    (warning,) = rp.residency_warnings(gpus, rp.residency_modes(cfg))
    assert warning.startswith("models.teachers[].residency: always for teacher on node 0 GPU 0: ")
    never, _ = decided([*OOM, "models.teachers.0.residency=never"], 139.8)
    assert never.offload == {"teacher"} and never.reasons == ("teacher teacher: residency never",)


def test_an_unknown_gpu_memory_offloads_auto_teachers() -> None:
    decision, (gpu,) = decided(OOM)
    assert decision.offload == {"teacher"} and gpu.capacity_gib is None
    assert "its memory is unknown; set cluster.group.gpu_memory_gb" in decision.reasons[0]
    cfg = load_run_config(str(CONFIG), OOM, False)  # models not readable here: nothing to decide from
    unplanned, _ = rp.planned_residency(cfg, place_children(cfg), lambda path: None, capacity_gib=139.8)
    assert unplanned.offload == {"teacher"} and "actor 0 is not planned (" in unplanned.reasons[0]


def _teacher(tid: str, gib: float) -> mp.ChildMemory:
    return mp.ChildMemory(
        f"teacher {tid}",
        (mp.Holding("weights", int(gib * GIB), "teacher"), mp.Holding("scoring buffers", GIB, "teacher")),
        teacher=tid,
    )


def test_the_largest_auto_teacher_leaves_first_and_only_as_many_as_needed() -> None:
    actor = mp.ChildMemory(
        "actor 0", (mp.Holding("state", 50 * GIB), mp.Holding("activations", 30 * GIB, "train"))
    )
    small, big, pinned = _teacher("small", 4), _teacher("big", 16), _teacher("pinned", 8)
    context = 4 * mp.CUDA_CONTEXT_BYTES / GIB
    gpu = mp.GpuMemory("group", 0, "0", (actor, small, big, pinned), 80 + 4 + 8 + context)
    modes = {"small": "auto", "big": "auto", "pinned": "always"}
    decision = rp.decide_residency((gpu,), modes)
    assert decision.offload == {"big"}  # 80 + 4 + 8 fits exactly; the big one had to go
    assert [r.split(":")[0] for r in decision.reasons] == ["teacher big", "teacher pinned", "teacher small"]
    roomy = mp.GpuMemory("group", 0, "0", (actor, small, big, pinned), 200)
    assert rp.decide_residency((roomy,), modes).offload == frozenset()
    tight = mp.GpuMemory("group", 0, "0", (actor, small, big, pinned), 85)
    assert rp.decide_residency((tight,), modes).offload == {"big", "small"}  # 'always' stays even then
    # A teacher over two GPUs is offloaded when one of them needs it.
    other = mp.GpuMemory("group", 0, "1", (big,), 200)
    assert "big" in rp.decide_residency((other, gpu), modes).offload
    with pytest.raises(ValueError, match="teacher 'big': residency 'sometimes'; expected one of"):
        rp.decide_residency((gpu,), {"big": "sometimes"})


class Teacher:
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def offload(self) -> dict:
        self.calls.append("offload")
        return {}


def test_the_drain_offloads_only_the_decided_teachers() -> None:
    from mopd_hpc.mopd.phases import Phase, PhaseMachine
    from mopd_hpc.trainer import controller as controller_module

    ctrl = object.__new__(controller_module.Controller)  # only what the drain reads
    ctrl.teachers = {"a": Teacher(), "b": Teacher()}
    ctrl.moving = {"b": ctrl.teachers["b"]}
    ctrl.machine = PhaseMachine(uses_teacher=True, consumers=["actor-0"])
    ctrl.step, ctrl.out = 0, io.StringIO()
    ctrl.machine.transition(Phase.TEACHER)
    asyncio.run(ctrl._drained([(0, 1, 4)]))
    assert ctrl.machine.phase is Phase.TRAIN
    assert (ctrl.teachers["a"].calls, ctrl.teachers["b"].calls) == ([], ["offload"])
    # Who moves: the decided teachers on a GPU (None: all of them, as before the decision), none on CPU.
    moving = controller_module.moving_teachers
    assert list(moving(ctrl.teachers, True, frozenset({"b"}))) == ["b"]
    assert list(moving(ctrl.teachers, True, None)) == ["a", "b"]
    assert moving(ctrl.teachers, False, None) == {}
