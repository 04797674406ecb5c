"""The `cluster:` section: backend (local or Slurm), job shape, and the resources of each het group.

Shapes (DESIGN.md §1, sbatch_templates/): 'heterogeneous' is a Slurm het job with component 0 = the
`trainer` group (actor and teachers) and the last component = the `rollout` group; 'colocated' is one
component, `group`, where actor, teachers and rollout share the nodes.

Teacher placement (`teacher_placement`; NeMo-RL and verl likewise give a teacher or generation worker group
its own resource pool or share the policy's):
- 'colocated' (default): each teacher's replicas time-share the actor's GPUs (the phase machine slices them);
- 'own_gpus': the last `teacher_gpus_per_node` GPUs of every node of the trainer group (`trainer`, or `group`)
  are the teachers' only; the actor (and, in the colocated shape, the rollout engines) get the others;
- 'own_group': the teachers run in their own het group `teacher` (component 1, between `trainer` and
  `rollout`; shape heterogeneous only), on its GPUs, or on its CPUs when it has none.
A teacher with GPUs of its own is never offloaded between phases (nothing else computes there).
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
    teacher_gpus_per_node: int | None = Field(
        None,
        ge=1,
        description="With cluster.teacher_placement own_gpus, on the group that holds the actor: its last "
        "teacher_gpus_per_node GPUs of each node are the teachers' own (the actor gets the others); "
        "null = none (required with own_gpus, refused otherwise).",
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
    def teacher_gpus(self) -> int:
        """GPUs per node given to the teachers alone (teacher_gpus_per_node, null = 0)."""
        return self.teacher_gpus_per_node or 0

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
        description="'heterogeneous': `trainer` + `rollout` groups (a Slurm het job; with teacher_placement "
        "own_group also `teacher` between them); 'colocated': one `group`."
    )
    teacher_placement: Literal["colocated", "own_gpus", "own_group"] = Field(
        "colocated",
        description="Where the teachers' replicas run: 'colocated' on the actor's GPUs, time-sliced by the "
        "phases; 'own_gpus' on the last `teacher_gpus_per_node` GPUs of each node of the actor's group, theirs "
        "alone; 'own_group' in their own het group `cluster.teacher` (shape heterogeneous). Replicas × "
        "tensor_parallel are sized by the teachers' GPUs; a teacher with GPUs of its own is never offloaded.",
    )
    trainer: GroupConfig | None = Field(
        None,
        description="Het group 0 (actor, and teachers unless teacher_placement is own_group); shape "
        "heterogeneous.",
    )
    teacher: GroupConfig | None = Field(
        None,
        description="Het group 1 (the teachers' scoring servers), between trainer and rollout; shape "
        "heterogeneous with teacher_placement own_group only.",
    )
    rollout: GroupConfig | None = Field(
        None,
        description="The last het group (rollout engines: 1, or 2 after a teacher group); shape heterogeneous.",
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

    @property
    def teacher_group(self) -> GroupConfig:
        """The group the teachers run in: `teacher` with teacher_placement own_group, else the actor's."""
        return self.teacher if self.teacher_placement == "own_group" and self.teacher else self.trainer_group

    @property
    def teacher_group_name(self) -> str:
        """The name of `teacher_group` ('teacher', 'trainer' or 'group')."""
        if self.teacher_placement == "own_group" and self.teacher is not None:
            return "teacher"
        return "trainer" if self.shape == "heterogeneous" else "group"

    def groups(self) -> dict[str, GroupConfig]:
        """Het groups by name, in component order ({'trainer', ['teacher',] 'rollout'} or {'group'})."""
        names = ("trainer", "teacher", "rollout") if self.shape == "heterogeneous" else ("group",)
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def _needed(self) -> tuple[str, ...]:
        if self.shape == "colocated":
            return ("group",)
        own = self.teacher_placement == "own_group"
        return ("trainer", "teacher", "rollout") if own else ("trainer", "rollout")

    @model_validator(mode="after")
    def _check(self) -> ClusterConfig:
        problems = []
        needed = self._needed()
        for name in ("trainer", "teacher", "rollout", "group"):
            value = getattr(self, name)
            if name in needed and value is None:
                problems.append(
                    Problem(
                        name, f"required for shape {self.shape!r}", None, "a group: nodes, gpus_per_node, ..."
                    )
                )
            elif name not in needed and value is not None:
                why = (
                    f"set, but teacher_placement is {self.teacher_placement!r}"
                    if name == "teacher" and self.shape == "heterogeneous"
                    else f"set, but shape {self.shape!r} has no such group"
                )
                problems.append(Problem(name, why, expected=f"use {' and '.join(needed)}"))
        problems.extend(self._actor_ranks_problems(needed))
        problems.extend(self._teacher_placement_problems(needed))
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

    def _teacher_placement_problems(self, names: tuple[str, ...]) -> list[Problem]:
        """own_group needs the heterogeneous shape; teacher_gpus_per_node only with own_gpus, on the actor's
        group, at least one GPU left to the actor on each node."""
        problems = []
        if self.teacher_placement == "own_group" and self.shape == "colocated":
            problems.append(
                Problem(
                    "teacher_placement",
                    "a teacher het group needs a heterogeneous job (shape colocated is one group)",
                    self.teacher_placement,
                    "shape: heterogeneous with a `teacher` group, or teacher_placement: own_gpus",
                )
            )
        actor_group = "trainer" if self.shape == "heterogeneous" else "group"
        for name in names:
            group = getattr(self, name)
            if group is None or group.teacher_gpus_per_node is None:
                continue
            path = join_path(name, "teacher_gpus_per_node")
            if name != actor_group:
                problems.append(
                    Problem(path, f"only the actor's group ({actor_group}) gives GPUs to the teachers",
                            group.teacher_gpus_per_node, f"null; set it on cluster.{actor_group}")
                )  # fmt: skip
            elif self.teacher_placement != "own_gpus":
                problems.append(
                    Problem(path, f"set, but teacher_placement is {self.teacher_placement!r}",
                            group.teacher_gpus_per_node, "null, or teacher_placement: own_gpus")
                )  # fmt: skip
            elif group.teacher_gpus_per_node >= group.gpus_per_node:
                problems.append(
                    Problem(
                        path,
                        f"leaves no GPU of a node to the actor (cluster.{name}.gpus_per_node is {group.gpus_per_node})",
                        group.teacher_gpus_per_node,
                        f"below {group.gpus_per_node}, or teacher_placement: own_group (a teacher het group)"
                        if group.gpus_per_node
                        else "give the group GPUs, or teacher_placement: own_group (a teacher het group)",
                    )
                )
        group = getattr(self, actor_group)
        if self.teacher_placement == "own_gpus" and group is not None and group.teacher_gpus_per_node is None:
            problems.append(
                Problem(
                    join_path(actor_group, "teacher_gpus_per_node"),
                    "teacher_placement own_gpus gives the teachers GPUs of the actor's nodes: how many per node",
                    None,
                    "the teachers' GPUs per node (≥ 1, below gpus_per_node), or teacher_placement: colocated",
                )
            )
        return problems

    def _actor_ranks_problems(self, names: tuple[str, ...]) -> list[Problem]:
        """actor_ranks_per_node above 1 only on a CPU group that holds the actor (`trainer` or `group`)."""
        problems = []
        for name in names:
            group = getattr(self, name)
            ranks = None if group is None else group.actor_ranks_per_node
            if ranks in (None, 1):
                continue
            path = join_path(name, "actor_ranks_per_node")
            if name in ("rollout", "teacher"):
                problems.append(
                    Problem(
                        path,
                        f"the {name} group holds no actor rank",
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
