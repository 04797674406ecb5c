"""The job plan: children, GPUs, named ports, ranks and AWEX transfer ranks derived from configs before anything
starts; the JobSpec and rank map built from it; the guard's share of it (autostart's node assignment)."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest
from helpers_configs import NO_SFT_WARMUP

from mopd_hpc.config import load_run_config
from mopd_hpc.launch.from_config import guard_command, jobspec_from_config
from mopd_hpc.launch.rankmap import compact_ranges, rank_map_rows
from mopd_hpc.launch.render import render
from mopd_hpc.plan.placement import place_children
from mopd_hpc.runtime.guard.autostart import assign_node, map_gpus
from mopd_hpc.runtime.plan import ChildSpec, JobPlan, PlanError, child_environment

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"


def plan_of(name: str, *overrides: str) -> JobPlan:
    return place_children(load_run_config(CONFIGS / name, overrides))


def gpu_owners(plan: JobPlan, role: str) -> Counter[tuple[int, int, str]]:
    """(het group, node, GPU ordinal) → number of `role` children computing on it."""
    owners: Counter[tuple[int, int, str]] = Counter()
    for c in plan.by_role(role):
        base = c.device_index or 0
        used = c.gpus[base : base + (4 if role == "rollout" else 1)] if c.gpus else ()
        owners.update((c.het_group, c.node_index, g) for g in used)
    return owners


def test_qwen3_coder_4node_rank_map() -> None:
    plan = plan_of("qwen3_coder_4node.yaml")
    actors, rollouts, teachers = plan.by_role("actor"), plan.by_role("rollout"), plan.by_role("teacher")
    assert len(actors) == 32 and len(rollouts) == 8 and len(teachers) == 32
    assert [a.index for a in actors] == list(range(32))
    # 8 actor ranks per trainer node, one GPU each; 2 endpoints of TP 4 per rollout node
    assert Counter(a.node_index for a in actors) == {0: 8, 1: 8, 2: 8, 3: 8}
    assert {a.het_group for a in actors} == {0} and {r.het_group for r in rollouts} == {1}
    assert all(len(a.gpus) == 1 for a in actors)
    assert [(r.node_index, r.gpus) for r in rollouts[:2]] == [
        (0, ("0", "1", "2", "3")),
        (0, ("4", "5", "6", "7")),
    ]
    # dense, unique transfer ranks: rollout 0..31 (engine·4 + rank), trainer 32..63
    ranks = [t for c in plan.children for t in c.transfer_ranks]
    assert sorted(ranks) == list(range(64))
    assert [r.transfer_ranks for r in rollouts][3] == (12, 13, 14, 15)
    assert [a.transfer_ranks for a in actors][:2] == [(32,), (33,)]
    assert plan.infer_world == 32 and plan.train_world == 32 and plan.transfer_world == 64
    # no GPU given twice within a role that runs at the same time
    assert max(gpu_owners(plan, "actor").values()) == 1 and len(gpu_owners(plan, "actor")) == 32
    assert max(gpu_owners(plan, "rollout").values()) == 1 and len(gpu_owners(plan, "rollout")) == 32
    # named ports per child
    assert all(r.port_names == ("http", "nccl", "dist_init") for r in rollouts)
    # the torch broadcast's group: actor rank 0 leases its nccl port too
    assert actors[0].port_names == ("master", "nccl") and all(a.port_names == () for a in actors[1:])
    # 4 replicas of TP 8: each leader serves http and leases its TP group's rendezvous port
    assert [t.port_names for t in teachers[:9]] == [("http", "master")] + [()] * 7 + [("http", "master")]
    t9 = teachers[9].env_dict
    assert (t9["MOPD_TEACHER_REPLICA"], t9["MOPD_RANK"], t9["MOPD_WORLD_SIZE"]) == ("1", "1", "8")
    env = actors[9].env_dict
    assert (env["MOPD_RANK"], env["MOPD_WORLD_SIZE"], env["MOPD_LOCAL_RANK"], env["MOPD_LOCAL_WORLD_SIZE"]) == (
        "9", "32", "1", "8")  # fmt: skip
    assert teachers[0].env_dict["MOPD_TEACHER_ID"] == "coder_teacher"


def test_het_cpu_plan_places_roles_on_their_groups() -> None:
    plan = plan_of("slurm_het_cpu.yaml")
    assert [(g.name, g.nodes) for g in plan.groups] == [("trainer", 1), ("rollout", 2)]
    assert [(c.role, c.index, c.het_group, c.node_index) for c in plan.children] == [
        ("actor", 0, 0, 0), ("teacher", 0, 0, 0), ("teacher", 1, 0, 0), ("rollout", 0, 1, 0), ("rollout", 1, 1, 1),
    ]  # fmt: skip
    assert [c.transfer_ranks for c in plan.children] == [(2,), (), (), (0,), (1,)]
    assert all(c.gpus == () for c in plan.children)
    assert plan.children_for(1, 1) == (plan.children[4],)


def test_colocated_gpu_plan_shares_the_node_and_pairs_devices() -> None:
    plan = plan_of("gsm8k_qwen3_14b_to_0_6b.yaml")
    everything = tuple(str(g) for g in range(8))
    assert all(c.gpus == everything for c in plan.children)  # colocated: every child sees the node's GPUs
    assert [a.device_index for a in plan.by_role("actor")] == list(range(8))
    assert [r.device_index for r in plan.by_role("rollout")] == list(range(8))  # SGLang base_gpu_id
    assert sorted(t for c in plan.children for t in c.transfer_ranks) == list(range(16))


def test_colocated_shape_separated_mode_splits_the_gpus() -> None:
    plan = plan_of(
        "gsm8k_qwen3_14b_to_0_6b.yaml",
        "rollout.mode=separated", "weight_sync.backend=torch", "weight_sync.awex_mode=null",
        "models.actor.tensor_parallel=4", "models.teachers[0].tensor_parallel=4", "rollout.engines.count=2",
        "rollout.engines.tensor_parallel=2",
    )  # fmt: skip
    assert [a.gpus for a in plan.by_role("actor")] == [("0",), ("1",), ("2",), ("3",)]
    assert [r.gpus for r in plan.by_role("rollout")] == [("4", "5"), ("6", "7")]
    assert [t.gpus for t in plan.by_role("teacher")] == [
        ("0",),
        ("1",),
        ("2",),
        ("3",),
    ]  # on the actor's GPUs


def test_plan_errors_name_the_problem() -> None:
    with pytest.raises(PlanError, match=r"tensor_parallel=8 does not divide the actor's 4 ranks"):
        plan_of(
            "gsm8k_qwen3_14b_to_0_6b.yaml",
            "rollout.mode=separated", "weight_sync.backend=torch", "weight_sync.awex_mode=null",
            "models.actor.tensor_parallel=4", "rollout.engines.count=2", "rollout.engines.tensor_parallel=2",
        )  # fmt: skip
    with pytest.raises(PlanError, match="env MOPD_ROLE is set by the guard"):
        ChildSpec.create(role="actor", index=0, het_group=0, node_index=0, env={"MOPD_ROLE": "x"})
    with pytest.raises(PlanError, match=r"gpus=\('0', '0'\)"):
        ChildSpec.create(role="actor", index=0, het_group=0, node_index=0, gpus=["0", "0"])
    with pytest.raises(PlanError, match="role='trainer'"):
        ChildSpec.create(role="trainer", index=0, het_group=0, node_index=0)


def test_no_teacher_without_distillation() -> None:
    plan = plan_of("local_cpu.yaml", "loss.distillation_coefficient=0", "loss.rl_coefficient=1",
                   "data.samples_per_prompt=2", NO_SFT_WARMUP)  # fmt: skip
    assert plan.by_role("teacher") == ()


def test_json_round_trip_and_probe_mapping(tmp_path: Path) -> None:
    plan = plan_of("qwen3_coder_4node.yaml")
    path = plan.write(tmp_path / "plan.json")
    assert JobPlan.load(path) == plan
    probes = plan.as_probe()
    assert probes.probe and {c.role for c in probes.children} == {"probe"}
    assert [c.index for c in probes.children] == list(range(72))
    for before, after in zip(plan.children, probes.children, strict=True):
        assert (after.het_group, after.node_index, after.gpus, after.port_names, after.transfer_ranks) == (
            before.het_group, before.node_index, before.gpus, before.port_names, before.transfer_ranks)  # fmt: skip
        assert after.env_dict["MOPD_PLAN_ROLE"] == before.role
        assert after.env_dict["MOPD_PLAN_INDEX"] == str(before.index)
    bad = json.loads(path.read_text())
    bad["children"][0]["node_index"] = 9
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(PlanError, match="het group 0 node 9 is outside"):
        JobPlan.load(tmp_path / "bad.json")


def test_child_environment_carries_the_plan() -> None:
    child = plan_of("gsm8k_qwen3_14b_to_0_6b.yaml").by_role("rollout")[3]
    env = child_environment(child, "slurm", 1)
    assert env["MOPD_TRANSFER_RANKS"] == "3" and env["MOPD_BASE_GPU_ID"] == "3"
    assert (env["MOPD_BACKEND"], env["MOPD_HET_GROUP"], env["MOPD_HET_SIZE"], env["MOPD_RANK"]) == (
        "slurm",
        "0",
        "1",
        "3",
    )


def test_rank_map_rows() -> None:
    rows = rank_map_rows(plan_of("qwen3_coder_4node.yaml"))
    rollout = [r for r in rows if r["role"] == "rollout"]
    assert rollout[1] == {
        "component": "1:rollout", "node": "0", "role": "rollout", "index": "1", "model": "-", "gpus": "4,5,6,7",
        "ports": "http, nccl, dist_init (assigned at start)", "transfer_rank": "4-7",
    }  # fmt: skip
    assert compact_ranges([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11" and compact_ranges([]) == "-"


def test_jobspec_from_config(tmp_path: Path) -> None:
    cfg = load_run_config(CONFIGS / "slurm_het_cpu.yaml")
    plan = place_children(cfg).as_probe()
    spec = jobspec_from_config(cfg, tmp_path / "run", sys.executable, plan)
    assert spec.shape == "heterogeneous" and [c.name for c in spec.components] == ["trainer", "rollout"]
    assert [c.nodes for c in spec.components] == [1, 2] and spec.components[1].roles == ("probe",)
    assert spec.guard_command[-4:] == ("--plan", str(tmp_path / "run" / "plan.json"), "--bind", "auto")
    assert (
        spec.secret_file == str(tmp_path / "run" / "guard.token") and spec.requeue and spec.max_requeues == 3
    )
    script = render(spec).script
    assert "#SBATCH hetjob" in script and "--het-group=1" in script
    colocated = jobspec_from_config(
        load_run_config(CONFIGS / "gsm8k_qwen3_14b_to_0_6b.yaml"), tmp_path, "/x/python"
    )
    assert colocated.shape == "colocated" and colocated.components[0].roles == ("actor", "teacher", "rollout")
    assert colocated.components[0].gpus_per_node == 8 and colocated.extra_sbatch == ("--exclusive",)
    assert guard_command("/nowhere/bin/python", "/r/plan.json")[:3] == (
        "/nowhere/bin/python",
        "-m",
        "mopd_hpc.cli.guard",
    )


def _slurm_env(het_group: int, node: str, nodes: str, gpus: str = "") -> dict[str, str]:
    return {
        "SLURM_JOB_ID": "77", "SLURM_HET_SIZE": "2", "SLURM_PROCID": "1", "SLURM_NODEID": "1", "SLURM_LOCALID": "0",
        "SLURM_STEP_NODELIST": nodes, "SLURM_NTASKS": "2", "SLURMD_NODENAME": node, "MOPD_HET_GROUP": str(het_group),
        "SLURM_JOB_NODELIST_HET_GROUP_0": "a1", "SLURM_JOB_NODELIST_HET_GROUP_1": nodes, "CUDA_VISIBLE_DEVICES": gpus,
    }  # fmt: skip


def test_guard_assignment_from_its_environment() -> None:
    plan = plan_of("slurm_het_cpu.yaml")
    mine = assign_node(plan, _slurm_env(1, "b2", "b[1-2]"))
    assert (mine.backend, mine.het_group, mine.node_index) == ("slurm", 1, 1)
    assert [(c.role, c.index) for c in mine.children] == [("rollout", 1)]
    local = assign_node(plan, {"MOPD_BACKEND": "local"})
    assert local.backend == "local" and local.children == plan.children
    with pytest.raises(PlanError, match="runs on 3 node"):
        assign_node(plan, _slurm_env(1, "b2", "b[1-3]"))


def test_gpu_ordinals_map_onto_the_guards_tokens() -> None:
    child = plan_of("qwen3_coder_4node.yaml").by_role("rollout")[1]
    visible = ["GPU-a", "GPU-b", "GPU-c", "GPU-d", "GPU-e", "GPU-f", "GPU-g", "GPU-h"]
    assert map_gpus(child, visible) == ["GPU-e", "GPU-f", "GPU-g", "GPU-h"]
    with pytest.raises(PlanError, match="planned on GPU 4 of its node, but the guard sees 2"):
        map_gpus(child, ["0", "1"])
