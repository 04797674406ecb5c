"""The actor's residency decision in the job (issue 21 item 4): which teachers leave the GPU between phases.

Rank 0 reads the job plan (`run_dir/plan.json`, written by mopd-submit), detects its GPU's memory
(`torch.cuda.get_device_properties(...).total_memory`, used where a group has no `cluster.<group>.gpu_memory_gb`)
and takes `plan.residency_plan.planned_residency`'s decision; the decision's lines go to the actor's output.
On CPU nothing moves: no decision (the controller moves no teacher).
"""

from __future__ import annotations

import logging
from typing import Any, TextIO

from mopd_hpc.plan.memory_plan import GIB, format_memory_plan
from mopd_hpc.plan.residency_plan import planned_residency
from mopd_hpc.records.run_dir import PLAN_FILE
from mopd_hpc.runtime.plan import JobPlan, PlanError

log = logging.getLogger("mopd_hpc.roles.residency")


def teachers_to_offload(role: Any, cfg: Any, out: TextIO) -> frozenset[str] | None:
    """The ids of the teachers the controller offloads at each drain; None on CPU (nothing moves).

    Raises:
        PlanError: run_dir/plan.json missing or unreadable (every job has one: mopd-submit writes it).
    """
    if not role.device.is_cuda:
        return None
    import torch

    plan = JobPlan.load(role.run_dir / PLAN_FILE)
    capacity = torch.cuda.get_device_properties(role.device.torch_name).total_memory / GIB
    decision, gpus = planned_residency(cfg, plan, capacity_gib=capacity)
    for line in format_memory_plan(gpus) + decision.lines:
        print(line, file=out, flush=True)
        log.info("%s", line)
    return decision.offload


__all__ = ["PlanError", "teachers_to_offload"]
