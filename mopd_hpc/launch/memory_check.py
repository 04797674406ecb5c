"""`mopd-submit`'s memory check: the job's memory plan held to the GPUs' memory before anything starts.

Each group's GPU memory is its `cluster.<group>.gpu_memory_gb` or `gpu_type`; with the local backend a group
that gives neither is held to this machine's GPUs (the smallest `nvidia-smi --query-gpu=memory.total`: the job
runs on them). A plan over a known memory is refused with the way out that fits (`plan/memory_fit.py`); where
no memory is known the check says so in one line.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mopd_hpc.config.parallel import ParallelError
from mopd_hpc.plan.memory_fit import capacity_known, memory_refusals
from mopd_hpc.plan.memory_plan import ConfigReader, read_model_config
from mopd_hpc.plan.placement import place_children
from mopd_hpc.runtime.plan import PlanError

#: What gives a local job's GPU memory, as a refusal names it.
LOCAL_SOURCE = "this machine's GPU (nvidia-smi memory.total)"
UNCHECKED = (
    "memory plan: not checked against the GPUs' memory, which is unknown here (set cluster.<group>.gpu_type, "
    "e.g. H100-80GB or H200-141GB, or gpu_memory_gb)"
)


def nvidia_smi_memory_gib() -> float | None:
    """The smallest memory.total of this machine's GPUs in GiB (nvidia-smi reports MiB); None without any."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    query = [exe, "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
    try:
        listing = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True).stdout
        sizes = [float(line) for line in listing.split() if line.strip()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return min(sizes) / 1024 if sizes else None


@dataclass(frozen=True, slots=True)
class MemoryCheck:
    """`refusals`: the plan over the GPUs' memory (one entry, with its ways out), [] when it fits; `unchecked`:
    the one line saying the memory is unknown, "" when it was checked (or the job has no GPU)."""

    refusals: tuple[str, ...] = ()
    unchecked: str = ""


def memory_check(
    cfg: Any,
    read: ConfigReader = read_model_config,
    local_memory: Callable[[], float | None] = nvidia_smi_memory_gib,
) -> MemoryCheck:
    """The check of the module docstring for a validated RunConfig. A job that cannot be placed is not
    checked here (its placement error comes with the plan)."""
    if not any(g.gpus_per_node for g in cfg.cluster.groups().values()):
        return MemoryCheck()
    try:
        plan = place_children(cfg)
    except (PlanError, ParallelError):
        return MemoryCheck()
    capacity = None
    if not capacity_known(cfg) and cfg.cluster.backend == "local":
        capacity = local_memory()
    unchecked = "" if capacity_known(cfg, capacity) else UNCHECKED  # the GPUs whose memory is known are held
    refusals = memory_refusals(cfg, plan, read, capacity_gib=capacity, capacity_source=LOCAL_SOURCE)
    return MemoryCheck(tuple(refusals), unchecked)
