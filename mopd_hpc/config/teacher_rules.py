"""Cross-section rules of the teachers' placement (`cluster.teacher_placement`, config/cluster.py): what the
teachers' GPUs hold (config/parallel.py `teacher_gpus`), registered in config/rules.py.

- the engine runs where its group is: megatron needs the teachers' group to have GPUs;
- a replica's tensor_parallel GPUs stay inside one node: tensor_parallel divides the teachers' GPUs per node;
- replicas · tensor_parallel fit the teachers' GPUs (the actor's when colocated: the replicas share them);
- a teacher with GPUs of its own is never offloaded: `residency: never` is refused there (nothing else
  computes on those GPUs, so offloading frees memory for no one and costs a load per step);
- GPUs or a het group of the teachers' own need teachers: with loss.distillation_coefficient 0 none is
  started (mopd/plan.py ExecutionPlan), so they would sit idle (own_gpus) or end the job at once (own_group:
  a het component without a child ends its step, and the batch shell stops the job when one step ends).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from mopd_hpc.config.capabilities import TEACHER_ENGINES
from mopd_hpc.config.parallel import divisors, teacher_gpus
from mopd_hpc.config.problems import Problem, join_path, needs_gpus


def _per_node_field(cluster: Any) -> str:
    """The YAML field that gives the teachers' GPUs per node."""
    field = "teacher_gpus_per_node" if cluster.teacher_placement == "own_gpus" else "gpus_per_node"
    return f"cluster.{cluster.teacher_group_name}.{field}"


def teacher_layout(c: Any) -> Iterator[Problem]:
    """Each teacher's engine, tensor_parallel and replicas against the teachers' GPUs (module docstring)."""
    gpus = teacher_gpus(c.cluster, c.rollout)
    group, where = c.cluster.teacher_group, gpus.group_path
    for i, teacher in enumerate(c.models.teachers):
        path, tp = join_path("models", "teachers", i), teacher.tensor_parallel
        if group.gpus_per_node == 0:
            if "cpu" not in TEACHER_ENGINES[teacher.engine].devices:
                yield needs_gpus(f"{path}.engine", f"the {teacher.engine} engine", teacher.engine, where,
                                 "use engine: torch")  # fmt: skip
            elif tp > 1:
                yield needs_gpus(f"{path}.tensor_parallel", "tensor parallelism", tp, where)
            continue
        if gpus.per_node % tp:
            yield Problem(
                f"{path}.tensor_parallel",
                f"must divide {_per_node_field(c.cluster)} ({gpus.per_node})",
                tp,
                f"a divisor of the teachers' GPUs per node: {divisors(gpus.per_node)}",
            )
            continue
        wanted = (teacher.replicas or 0) * tp
        if wanted > gpus.size > 0:
            whose = (
                f"the teachers' {gpus.size} GPUs ({gpus.how})"
                if gpus.own
                else f"the actor's {gpus.size} GPUs, which the teacher's replicas share"
            )
            yield Problem(
                f"{path}.replicas",
                f"replicas·tensor_parallel = {teacher.replicas}·{tp} exceeds {whose}",
                teacher.replicas,
                f"at most {gpus.size // tp}, or null (derived)",
            )


def teacher_residency(c: Any) -> Iterator[Problem]:
    """`residency: never` on GPUs of the teachers' own (module docstring)."""
    if c.cluster.teacher_placement == "colocated" or c.cluster.teacher_group.gpus_per_node == 0:
        return
    for i, teacher in enumerate(c.models.teachers):
        if teacher.residency == "never":
            yield Problem(
                join_path("models", "teachers", i, "residency"),
                f"offloads the teacher between phases, but cluster.teacher_placement "
                f"{c.cluster.teacher_placement} gives it GPUs of its own, where nothing else computes",
                teacher.residency,
                "auto (resident on its own GPUs), or teacher_placement: colocated",
            )


def teachers_started(c: Any) -> Iterator[Problem]:
    """A placement of the teachers' own where no teacher is started (module docstring)."""
    if c.cluster.teacher_placement != "colocated" and c.loss.distillation_coefficient == 0:
        yield Problem(
            "cluster.teacher_placement",
            "gives the teachers resources of their own, but no teacher is started (loss.distillation_coefficient "
            "is 0)",
            c.cluster.teacher_placement,
            "colocated, or a distillation_coefficient > 0",
        )
