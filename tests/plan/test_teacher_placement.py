"""Teachers on GPUs of their own (issue 31 item 2): `cluster.teacher_placement` colocated (the actor's GPUs, as
before), own_gpus (the last `teacher_gpus_per_node` GPUs of each trainer node) and own_group (a `teacher` het
group). The plan puts each replica on the teachers' GPUs, sized by them; the rank map and `--dry-run` show each
replica's node and GPUs; a teacher with GPUs of its own stays resident; the config refuses what cannot run.
The same job on the local Slurm cluster: tests/e2e/test_main_job_slurm.py::test_teachers_in_their_own_het_group."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
from helpers_models import QWEN3_1_7B

from mopd_hpc.cli import submit
from mopd_hpc.config import ConfigError, load_run_config
from mopd_hpc.config.parallel import teacher_replicas
from mopd_hpc.launch.from_config import jobspec_from_config
from mopd_hpc.launch.rankmap import rank_map_rows, teacher_lines
from mopd_hpc.plan import residency_plan as rp
from mopd_hpc.plan.placement import place_children
from mopd_hpc.runtime.plan import JobPlan

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
#: qwen3_8gpu_colocated with its 8 GPUs split: actor TP 4 and 4 colocated rollout engines on GPUs 0-3 (AWEX
#: colocate pairs them), the teacher on GPUs 4-7 of its own.
OWN_GPUS = (
    "cluster.teacher_placement=own_gpus", "cluster.group.teacher_gpus_per_node=4",
    "models.actor.tensor_parallel=4", "rollout.engines.count=4",
)  # fmt: skip
#: the CPU het job with a `teacher` group of GPUs (slurm backend: a local het job is CPU only).
OWN_GROUP = (
    "cluster.teacher_placement=own_group", "cluster.teacher={nodes: 1, gpus_per_node: 4}",
    "cluster.trainer.gpus_per_node=2", "models.teachers[0].tensor_parallel=2",
)  # fmt: skip


def plan_of(name: str, *overrides: str) -> tuple[object, JobPlan]:
    cfg = load_run_config(CONFIGS / name, overrides)
    return cfg, place_children(cfg)


def used(plan: JobPlan, role: str) -> set[tuple[int, int, str]]:
    """(het group, node, GPU) of every GPU a `role` child computes on."""
    return {(c.het_group, c.node_index, g) for c in plan.by_role(role) for g in c.compute_gpus(1)}


def test_own_gpus_of_the_trainer_node_hold_the_teacher_alone() -> None:
    cfg, plan = plan_of("qwen3_8gpu_colocated.yaml", *OWN_GPUS, "models.teachers[0].tensor_parallel=2")
    assert used(plan, "actor") == used(plan, "rollout") == {(0, 0, str(g)) for g in range(4)}
    assert used(plan, "teacher") == {(0, 0, str(g)) for g in range(4, 8)}
    # replicas sized by the teacher's 4 GPUs (not the actor's): 2 of TP 2; each child sees its own GPU only
    assert teacher_replicas(cfg, cfg.models.teachers[0]) == 2
    teachers = plan.by_role("teacher")
    assert [(t.gpus, t.device_index, t.port_names) for t in teachers] == [
        (("4",), None, ("http", "master")), (("5",), None, ()), (("6",), None, ("http", "master")), (("7",), None, ()),
    ]  # fmt: skip
    assert [t.env_dict["MOPD_TEACHER_REPLICA"] for t in teachers] == ["0", "0", "1", "1"]
    # the actor and the engines still see the node's 8 GPUs (AWEX colocate pairs rank r with engine r)
    assert {a.gpus for a in plan.by_role("actor")} == {tuple(str(g) for g in range(8))}
    assert plan.train_world == plan.infer_world == 4
    assert teacher_lines(plan) == ["teacher teacher: 2 replica(s) × tp 2 — replica 0 on node 0 GPUs 4,5; "
                                   "replica 1 on node 0 GPUs 6,7"]  # fmt: skip
    # colocated (the default) keeps the old layout: one replica of TP 8 over the actor's 8 GPUs
    cfg, plan = plan_of("qwen3_8gpu_colocated.yaml")
    assert used(plan, "teacher") == used(plan, "actor") and len(used(plan, "teacher")) == 8


def test_own_group_puts_the_teachers_in_het_group_1() -> None:
    cfg, plan = plan_of(
        "slurm_het_cpu.yaml", *OWN_GROUP, "cluster.backend=slurm", "weight_sync.backend=torch"
    )
    assert [(g.name, g.het_group, g.nodes, g.gpus_per_node) for g in plan.groups] == [
        ("trainer", 0, 1, 2), ("teacher", 1, 1, 4), ("rollout", 2, 2, 0),
    ]  # fmt: skip
    assert used(plan, "teacher") == {(1, 0, str(g)) for g in range(4)}
    assert {c.het_group for c in plan.by_role("actor")} == {0} and len(plan.by_role("actor")) == 2
    assert {c.het_group for c in plan.by_role("rollout")} == {2}
    # teacher 0 (TP 2): 2 replicas over the group's 4 GPUs; teacher 1 (TP 1): 4 replicas on the same GPUs
    replicas = {t.id: teacher_replicas(cfg, t) for t in cfg.models.teachers}
    assert replicas == {"chain": 2, "legs": 4}
    rows = [r for r in rank_map_rows(plan, "torch") if r["role"] == "teacher"]
    assert [(r["component"], r["node"], r["model"], r["gpus"]) for r in rows][:3] == [
        ("1:teacher", "0", "chain r0, tp 0/2", "0"), ("1:teacher", "0", "chain r0, tp 1/2", "1"),
        ("1:teacher", "0", "chain r1, tp 0/2", "2"),
    ]  # fmt: skip
    assert teacher_lines(plan)[1] == (
        "teacher legs: 4 replica(s) × tp 1 — replica 0 on teacher node 0 GPU 0; replica 1 on teacher node 0 "
        "GPU 1; replica 2 on teacher node 0 GPU 2; replica 3 on teacher node 0 GPU 3"
    )
    # the sbatch job has three components, the teachers' with its own GPUs
    spec = jobspec_from_config(cfg, "/shared/run", sys.executable, plan)
    assert [(c.het_group, c.name, c.gpus_per_node, c.roles) for c in spec.components] == [
        (0, "trainer", 2, ("actor",)), (1, "teacher", 4, ("teacher",)), (2, "rollout", 0, ("rollout",)),
    ]  # fmt: skip
    # on CPU: one replica per teacher (unless set), round-robin over the teacher group's nodes
    _, cpu = plan_of(
        "slurm_het_teachers_cpu.yaml", "cluster.teacher.nodes=2", "models.teachers[1].replicas=3"
    )
    placed = sorted((t.index, t.env_dict["MOPD_TEACHER_REPLICA"], t.het_group, t.node_index)
                    for t in cpu.by_role("teacher"))  # fmt: skip
    assert placed == [(0, "0", 1, 0), (1, "0", 1, 0), (2, "1", 1, 1), (3, "2", 1, 0)]


def test_a_teacher_on_gpus_of_its_own_stays_resident_whatever_the_memory() -> None:
    """Unknown GPU memory offloads a colocated `auto` teacher (tests/plan/test_residency_plan.py); on its own GPUs it
    stays: nothing else would use what it frees."""
    cfg, plan = plan_of("qwen3_8gpu_colocated.yaml", *OWN_GPUS, "models.teachers[0].tensor_parallel=4")
    decision, gpus = rp.planned_residency(cfg, plan, lambda path: QWEN3_1_7B)
    assert decision.offload == frozenset()
    assert decision.reasons == ("teacher teacher: resident (GPUs of its own: node 0 GPU 4)",)
    # its weights are held in every phase on GPUs 4-7, and nothing but the teacher is planned there
    for gpu in gpus:
        labels = {c.label.split()[0] for c in gpu.children}
        assert labels == ({"teacher"} if int(gpu.gpu) >= 4 else {"actor", "rollout"}), (gpu.gpu, labels)
        if int(gpu.gpu) >= 4:
            (teacher,) = gpu.children
            assert teacher.holding("weights").phase is None
    cfg, plan = plan_of("qwen3_8gpu_colocated.yaml")  # colocated: the same teacher is offloaded
    decision, _ = rp.planned_residency(cfg, plan, lambda path: QWEN3_1_7B)
    assert decision.offload == {"teacher"}


def test_dry_run_shows_each_replica_on_its_own_gpus(tmp_path: Path) -> None:
    """`mopd-submit --dry-run` of qwen3_8gpu_colocated with the teacher on GPUs 4-7 of the node: the rank map
    rows, the replica line, the memory plan per GPU (config.json files of the Qwen3-1.7B shape) and the
    residency decision."""
    for name in ("student", "teacher"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(QWEN3_1_7B))
    sets = [*OWN_GPUS, "models.teachers[0].tensor_parallel=4", f"models.actor.path={tmp_path / 'student'}",
            f"models.tokenizer.path={tmp_path / 'student'}", f"models.teachers[0].path={tmp_path / 'teacher'}",
            f"run_dir={tmp_path / 'run'}"]  # fmt: skip
    argv = [str(CONFIGS / "qwen3_8gpu_colocated.yaml"), "--dry-run", *(a for s in sets for a in ("--set", s))]
    parser = submit.argparse.ArgumentParser()
    submit.add_arguments(parser)
    out, err = io.StringIO(), io.StringIO()
    assert submit.execute(parser.parse_args(argv), out=out, err=err, environ={}, python=sys.executable) == 0
    text = out.getvalue()
    assert "teacher teacher: 1 replica(s) × tp 4 — replica 0 on node 0 GPUs 4,5,6,7" in text
    for rank in range(4):
        assert f"│ teacher │ {rank}     │ -  │ -  │ teacher r0, tp {rank}/4 │ {4 + rank}  " in text, text
    plan_lines = text[text.index("# memory plan per GPU") : text.index("# residency")].splitlines()
    heads = [i for i, line in enumerate(plan_lines) if "cluster.group node 0 GPU" in line]
    assert len(heads) == 8
    for gpu, (start, end) in enumerate(zip(heads, [*heads[1:], len(plan_lines)], strict=True)):
        children = {line.split(":")[0].strip("# ").split()[0] for line in plan_lines[start + 1 : end]}
        assert children == ({"teacher"} if gpu >= 4 else {"actor", "rollout"}), (gpu, plan_lines[start:end])
    assert "# residency: teacher teacher: resident (GPUs of its own: node 0 GPU 4)" in text


@pytest.mark.parametrize(
    ("sets", "problem"),
    [
        (["cluster.group.teacher_gpus_per_node=2"],
         "cluster.group.teacher_gpus_per_node: set, but teacher_placement is 'colocated' (got 2; null, or "
         "teacher_placement: own_gpus)"),
        (["cluster.teacher_placement=own_gpus"],
         "cluster.group.teacher_gpus_per_node: teacher_placement own_gpus gives the teachers GPUs of the actor's "
         "nodes: how many per node (got null;"),
        (["cluster.teacher_placement=own_gpus", "cluster.group.teacher_gpus_per_node=8"],
         "cluster.group.teacher_gpus_per_node: leaves no GPU of a node to the actor (cluster.group.gpus_per_node "
         "is 8) (got 8; below 8, or teacher_placement: own_group (a teacher het group))"),
        (["cluster.teacher_placement=own_group"],
         "cluster.teacher_placement: a teacher het group needs a heterogeneous job (shape colocated is one "
         "group) (got 'own_group';"),
        ([*OWN_GPUS[:3], "rollout.engines.count=4", "cluster.group.teacher_gpus_per_node=4",
          "models.teachers[0].tensor_parallel=8"],
         "models.teachers[0].tensor_parallel: must divide cluster.group.teacher_gpus_per_node (4) (got 8; a "
         "divisor of the teachers' GPUs per node: 1, 2 or 4)"),
        ([*OWN_GPUS, "models.teachers[0].tensor_parallel=2", "models.teachers[0].replicas=3"],
         "models.teachers[0].replicas: replicas·tensor_parallel = 3·2 exceeds the teachers' 4 GPUs "
         "(cluster.group.nodes × teacher_gpus_per_node = 1 × 4) (got 3; at most 2, or null (derived))"),
        ([*OWN_GPUS, "models.teachers[0].tensor_parallel=4", "models.teachers[0].residency=never"],
         "models.teachers[0].residency: offloads the teacher between phases, but cluster.teacher_placement "
         "own_gpus gives it GPUs of its own, where nothing else computes (got 'never'; auto (resident on its "
         "own GPUs), or teacher_placement: colocated)"),
        ([*OWN_GPUS[:3], "models.teachers[0].tensor_parallel=4", "rollout.engines.count=8"],
         "rollout.engines.count: count·tensor_parallel = 8·1 exceeds the 4 GPUs of cluster.group not the "
         "teachers' own (got 8; at most 4)"),
    ],
)  # fmt: skip
def test_check_refuses_what_the_placement_cannot_run(sets: list[str], problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_run_config(CONFIGS / "qwen3_8gpu_colocated.yaml", sets)
    assert any(p.render().startswith(problem) for p in info.value.problems), str(info.value)


def test_the_teacher_group_is_only_where_the_placement_asks_for_it() -> None:
    with pytest.raises(ConfigError) as info:
        load_run_config(CONFIGS / "slurm_het_cpu.yaml", ["cluster.teacher={nodes: 1}"])
    assert [p.render() for p in info.value.problems] == [
        "cluster.teacher: set, but teacher_placement is 'colocated' (use trainer and rollout)"
    ]
    # no teacher started (c_d = 0): a teacher het group would have no child, its step would end the job
    no_teacher = ["loss.distillation_coefficient=0", "loss.rl_coefficient=1", "data.samples_per_prompt=2"]
    with pytest.raises(ConfigError) as info:
        load_run_config(CONFIGS / "slurm_het_teachers_cpu.yaml", no_teacher)
    assert [p.render() for p in info.value.problems] == [
        "cluster.teacher_placement: gives the teachers resources of their own, but no teacher is started "
        "(loss.distillation_coefficient is 0) (got 'own_group'; colocated, or a distillation_coefficient > 0)"
    ]
    with pytest.raises(ConfigError) as info:
        load_run_config(CONFIGS / "slurm_het_teachers_cpu.yaml", ["cluster.teacher.actor_ranks_per_node=2"])
    assert (
        info.value.problems[0]
        .render()
        .startswith("cluster.teacher.actor_ranks_per_node: the teacher group holds no actor rank (got 2;")
    )
