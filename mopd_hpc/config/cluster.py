"""The `cluster:` section: backend (local or Slurm), job shape, and the resources of each het group.

Shapes (DESIGN.md §1, sbatch_templates/): 'heterogeneous' is a Slurm het job with component 0 = the
`trainer` group (actor and teachers) and component 1 = the `rollout` group; 'colocated' is one
component, `group`, where actor, teachers and rollout share the nodes.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, StrictBool, field_validator, model_validator

from mopd_hpc.config.base import Section
from mopd_hpc.config.problems import Problem, join_path, raise_if_any
from mopd_hpc.config.types import NonEmptyStr

#: submitit's and our default: USR2 to the batch shell 120 s before the time limit ("NCCL may catch USR1").
DEFAULT_SIGNAL = "B:USR2@120"
#: Slurm `--signal=[{R|B}:]<sig_num>[@sig_time]`.
SIGNAL_PATTERN = re.compile(
    r"^(?:(?P<flags>[RB]{1,2}):)?(?P<sig>(?:SIG)?[A-Z][A-Z0-9]*|[0-9]{1,2})(?:@(?P<s>[0-9]+))?$"
)
#: One GPU's memory in GiB (2^30 bytes) per `cluster.<group>.gpu_type`: nvidia-smi's memory.total of each model
#: (H100 SXM 80GB: 81,559 MiB; H200 SXM: 143,771 MiB; A100 SXM 80GB: 81,920 MiB; A100 40GB: 40,960 MiB) / 1024.
GPU_TYPE_GIB: dict[str, float] = {
    "H100-80GB": 79.6,
    "H200-141GB": 140.4,
    "A100-80GB": 80.0,
    "A100-40GB": 40.0,
}
#: `#SBATCH` options that the config sets itself; `extra_sbatch` must not set them a second time.
MANAGED_SBATCH_OPTIONS: dict[str, str] = {
    "--nodes": "cluster.<group>.nodes",
    "-N": "cluster.<group>.nodes",
    "--gpus-per-node": "cluster.<group>.gpus_per_node",
    "--gres": "cluster.<group>.gpus_per_node",
    "--gpus": "cluster.<group>.gpus_per_node",
    "-G": "cluster.<group>.gpus_per_node",
    "--gpus-per-task": "cluster.<group>.gpus_per_node (one task per node sees all its GPUs)",
    "--cpus-per-task": "cluster.<group>.cpus_per_task",
    "-c": "cluster.<group>.cpus_per_task",
    "--mem": "cluster.<group>.mem_gb",
    "--mem-per-cpu": "cluster.<group>.mem_gb",
    "--mem-per-gpu": "cluster.<group>.mem_gb",
    "--partition": "cluster.<group>.partition",
    "-p": "cluster.<group>.partition",
    "--account": "cluster.<group>.account",
    "-A": "cluster.<group>.account",
    "--qos": "cluster.<group>.qos",
    "-q": "cluster.<group>.qos",
    "--time": "cluster.time_min",
    "-t": "cluster.time_min",
    "--signal": "cluster.signal",
    "--requeue": "cluster.requeue",
    "--no-requeue": "cluster.requeue",
    "--job-name": "name",
    "-J": "name",
    "--output": "run_dir (logs go there)",
    "-o": "run_dir (logs go there)",
    "--error": "run_dir (logs go there)",
    "-e": "run_dir (logs go there)",
    "--ntasks-per-node": "nothing (one guard per node, fixed)",
    "--ntasks": "nothing (one guard per node, fixed)",
    "-n": "nothing (one guard per node, fixed)",
}


class GroupConfig(Section):
    """Resources of one het group (one Slurm job component), per node."""

    nodes: int = Field(1, ge=1, description="Nodes in the group.")
    gpus_per_node: int = Field(0, ge=0, description="GPUs per node (0 = CPU only).")
    cpus_per_task: int = Field(
        1, ge=1, description="CPUs per node for its guard and children (one task per node)."
    )
    actor_ranks_per_node: int | None = Field(
        None,
        ge=1,
        description="Actor ranks per node of a group without GPUs (data parallelism on CPU; they share the "
        "node's cpus_per_task); null = 1. Only on the group that holds the actor; on a GPU group the ranks "
        "are its GPUs (null or 1).",
    )
    mem_gb: int | None = Field(
        None, ge=1, description="Memory per node, in GB; null = the partition default."
    )
    gpu_memory_gb: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Memory of one GPU of the group, in GiB (2^30 bytes, as torch reports it; an H200 has "
        "about 140); --check refuses a memory plan of a GPU over it, naming a way out that fits; null = "
        "gpu_type's, else this machine's GPU with the local backend, else not checked.",
    )
    gpu_type: Literal["H100-80GB", "H200-141GB", "A100-80GB", "A100-40GB"] | None = Field(
        None,
        description="The group's GPU model: its memory (GPU_TYPE_GIB) is the one --check holds the memory plan "
        "to, as gpu_memory_gb would; set one of the two.",
    )
    partition: NonEmptyStr | None = Field(None, description="Slurm partition; null = the cluster default.")
    account: NonEmptyStr | None = Field(None, description="Slurm account; null = the user's default.")
    qos: NonEmptyStr | None = Field(None, description="Slurm QOS; null = the default.")

    @model_validator(mode="after")
    def _one_capacity(self) -> GroupConfig:
        if self.gpu_memory_gb is not None and self.gpu_type is not None:
            known = GPU_TYPE_GIB[self.gpu_type]
            raise_if_any(
                [
                    Problem(
                        "gpu_type",
                        f"the GPU's memory is given twice: gpu_type {self.gpu_type} ({known:g} GiB) and "
                        f"gpu_memory_gb {self.gpu_memory_gb:g}",
                        self.gpu_type,
                        "set one of gpu_type and gpu_memory_gb",
                    )
                ]
            )
        return self

    @property
    def capacity_gib(self) -> float | None:
        """One GPU's memory in GiB: gpu_memory_gb, else gpu_type's (GPU_TYPE_GIB), else None (unknown)."""
        if self.gpu_memory_gb is not None:
            return self.gpu_memory_gb
        return GPU_TYPE_GIB[self.gpu_type] if self.gpu_type is not None else None

    @property
    def capacity_field(self) -> str:
        """The field that gives `capacity_gib` ('gpu_memory_gb', 'gpu_type'), '' when none does."""
        return "gpu_memory_gb" if self.gpu_memory_gb is not None else ("gpu_type" if self.gpu_type else "")

    @property
    def gpus(self) -> int:
        """GPUs in the whole group (nodes · gpus_per_node)."""
        return self.nodes * self.gpus_per_node

    @property
    def actor_slots_per_node(self) -> int:
        """Actor ranks a node of this group can hold: one per GPU, else actor_ranks_per_node (null = 1)."""
        return self.gpus_per_node or (self.actor_ranks_per_node or 1)


class ClusterConfig(Section):
    """Where and how the job runs."""

    backend: Literal["local", "slurm"] = Field(
        description="'slurm': sbatch through submitit; 'local': this machine, no Slurm (its CPUs; its GPUs for shape "
        "colocated, the first gpus_per_node of CUDA_VISIBLE_DEVICES, else of nvidia-smi's list). "
        "`mopd-submit --local` overrides it to 'local'."
    )
    shape: Literal["heterogeneous", "colocated"] = Field(
        description="'heterogeneous': `trainer` + `rollout` groups (a Slurm het job); 'colocated': one `group`."
    )
    trainer: GroupConfig | None = Field(
        None, description="Het group 0 (actor, teachers); shape heterogeneous."
    )
    rollout: GroupConfig | None = Field(
        None, description="Het group 1 (rollout engines); shape heterogeneous."
    )
    group: GroupConfig | None = Field(None, description="The single group; shape colocated.")
    time_min: int = Field(60, ge=1, description="Job time limit, in minutes.")
    signal: str = Field(
        DEFAULT_SIGNAL,
        description="Slurm --signal: which signal, to whom (B: the batch shell), how many seconds before "
        "the time limit; the guards checkpoint on it.",
    )
    requeue: StrictBool = Field(True, description="Requeue the job after preemption or the timeout signal.")
    max_requeues: int = Field(3, ge=0, description="Most requeues (by SLURM_RESTART_COUNT) before giving up.")
    extra_sbatch: list[str] = Field(
        default_factory=list, description="Extra `#SBATCH` options, verbatim (e.g. '--constraint=h200')."
    )

    @field_validator("signal")
    @classmethod
    def _signal(cls, value: str) -> str:
        if not SIGNAL_PATTERN.match(value):
            raise ValueError(
                f"not a Slurm --signal value: {value!r}; expected [B:|R:]SIG[@SECONDS], e.g. 'B:USR2@120'"
            )
        return value

    @property
    def signal_lead_s(self) -> int:
        """Seconds before the time limit at which Slurm sends the signal (Slurm's default is 60)."""
        match = SIGNAL_PATTERN.match(self.signal)
        assert match is not None  # validated above
        return int(match["s"]) if match["s"] else 60

    @property
    def trainer_group(self) -> GroupConfig:
        """The group of the actor and teachers (`trainer`, or `group` when colocated)."""
        group = self.trainer if self.shape == "heterogeneous" else self.group
        assert group is not None  # validated
        return group

    @property
    def rollout_group(self) -> GroupConfig:
        """The group of the rollout engines (`rollout`, or `group` when colocated)."""
        group = self.rollout if self.shape == "heterogeneous" else self.group
        assert group is not None  # validated
        return group

    def groups(self) -> dict[str, GroupConfig]:
        """Het groups by name, in component order ({'trainer', 'rollout'} or {'group'})."""
        names = ("trainer", "rollout") if self.shape == "heterogeneous" else ("group",)
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    @model_validator(mode="after")
    def _check(self) -> ClusterConfig:
        problems = []
        needed = {"heterogeneous": ("trainer", "rollout"), "colocated": ("group",)}[self.shape]
        for name in ("trainer", "rollout", "group"):
            value = getattr(self, name)
            if name in needed and value is None:
                problems.append(
                    Problem(
                        name, f"required for shape {self.shape!r}", None, "a group: nodes, gpus_per_node, ..."
                    )
                )
            elif name not in needed and value is not None:
                problems.append(
                    Problem(
                        name,
                        f"set, but shape {self.shape!r} has no such group",
                        expected=f"use {' and '.join(needed)}",
                    )
                )
        problems.extend(self._actor_ranks_problems(needed))
        if self.backend == "local" and self.shape == "heterogeneous":
            for name in needed:
                group = getattr(self, name)
                if group is not None and group.gpus_per_node > 0:
                    problems.append(
                        Problem(
                            join_path(name, "gpus_per_node"),
                            "a local heterogeneous job runs both groups on this one machine, on CPU",
                            group.gpus_per_node,
                            "set 0, or shape: colocated (one group on this machine's GPUs), or cluster.backend: slurm",
                        )
                    )
        if self.signal_lead_s >= self.time_min * 60:
            problems.append(
                Problem(
                    "signal",
                    f"fires {self.signal_lead_s} s before the end of a {self.time_min}-minute job, i.e. at its start",
                    self.signal,
                    "a lead time shorter than cluster.time_min",
                )
            )
        for i, option in enumerate(self.extra_sbatch):
            problems.extend(_sbatch_option_problems(join_path("extra_sbatch", i), option))
        raise_if_any(problems)
        return self

    def _actor_ranks_problems(self, names: tuple[str, ...]) -> list[Problem]:
        """actor_ranks_per_node above 1 only on a CPU group that holds the actor (`trainer` or `group`)."""
        problems = []
        for name in names:
            group = getattr(self, name)
            ranks = None if group is None else group.actor_ranks_per_node
            if ranks in (None, 1):
                continue
            path = join_path(name, "actor_ranks_per_node")
            if name == "rollout":
                problems.append(
                    Problem(
                        path,
                        "the rollout group holds no actor rank",
                        ranks,
                        "null; set it on cluster.trainer (the group of the actor)",
                    )
                )
            elif group.gpus_per_node:
                problems.append(
                    Problem(
                        path,
                        f"on a group with GPUs the actor's ranks are its GPUs ({name}.gpus_per_node is "
                        f"{group.gpus_per_node}: one rank per GPU)",
                        ranks,
                        "null (or 1); more ranks need more GPUs per node, or gpus_per_node: 0 for CPU ranks",
                    )
                )
        return problems


def _sbatch_option_problems(path: str, option: str) -> list[Problem]:
    if "\n" in option or "\r" in option or not option.startswith("-"):
        return [
            Problem(path, "not one sbatch option", option, "one option per item, e.g. '--constraint=h200'")
        ]
    flag = option.split("=", 1)[0].split()[0] if option.startswith("--") else option[:2]
    if flag in MANAGED_SBATCH_OPTIONS:
        return [
            Problem(
                path, f"{flag} is set by the config", option, f"set {MANAGED_SBATCH_OPTIONS[flag]} instead"
            )
        ]
    return []
