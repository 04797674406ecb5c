"""The actor group's placement (issue 16): one actor child per trainer slot, several per CPU node
(`actor_ranks_per_node`), its rank variables, the named ports `master` and `nccl` on rank 0 only, one child
per teacher on a CPU trainer group; the rank map's DP/TP columns and shape line; the 2-trainer-node het plan;
`mopd-submit --check/--dry-run` of the shipped DP = 2 configs."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from helpers_configs import submit_here
from rich.console import Console

from mopd_hpc.config import load_run_config
from mopd_hpc.config.parallel import ActorParallel
from mopd_hpc.launch.from_config import jobspec_from_config
from mopd_hpc.launch.rankmap import print_rank_map, rank_map_rows, shape_line
from mopd_hpc.plan.placement import place_children

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
DP2 = CONFIGS / "local_cpu_dp2.yaml"
HET_DP2 = CONFIGS / "slurm_het_cpu_dp2.yaml"
RANK_KEYS = ("MOPD_RANK", "MOPD_WORLD_SIZE", "MOPD_LOCAL_RANK", "MOPD_LOCAL_WORLD_SIZE")


def ranks(child) -> tuple[str, ...]:
    return tuple(child.env_dict[k] for k in RANK_KEYS)


def test_two_actor_ranks_on_one_cpu_node() -> None:
    plan = place_children(load_run_config(DP2))
    assert [(c.role, c.index, c.het_group, c.node_index) for c in plan.children] == [
        ("actor", 0, 0, 0), ("actor", 1, 0, 0), ("teacher", 0, 0, 0), ("teacher", 1, 0, 0), ("rollout", 0, 0, 0),
    ]  # fmt: skip
    actors = plan.by_role("actor")
    assert [ranks(a) for a in actors] == [("0", "2", "0", "2"), ("1", "2", "1", "2")]
    assert [a.port_names for a in actors] == [("master", "nccl"), ()]  # rendezvous + weight-sync store
    assert all(a.gpus == () and a.device_index is None for a in actors)
    # DP/TP ranks are derived (ActorParallel.from_config(cfg).coords(MOPD_RANK)), not put into the env
    assert {k for a in actors for k in a.env_dict} == set(RANK_KEYS)
    # one child per teacher (a single replica on node 0), not one per actor rank
    teachers = plan.by_role("teacher")
    assert [(t.index, t.env_dict["MOPD_TEACHER_ID"], t.port_names, ranks(t)) for t in teachers] == [
        (0, "chain", ("http",), ("0", "1", "0", "1")), (1, "legs", ("http",), ("0", "1", "0", "1")),
    ]  # fmt: skip
    assert plan.train_world == 2 and plan.by_role("rollout")[0].port_names == ("http", "nccl", "dist_init")


def test_cpu_ranks_per_node_times_nodes() -> None:
    cfg = load_run_config(DP2, ["cluster.group.nodes=2"])
    plan = place_children(cfg)
    actors = plan.by_role("actor")
    assert [(a.index, a.node_index, a.env_dict["MOPD_LOCAL_RANK"]) for a in actors] == [
        (0, 0, "0"), (1, 0, "1"), (2, 1, "0"), (3, 1, "1"),
    ]  # fmt: skip
    assert {a.env_dict["MOPD_WORLD_SIZE"] for a in actors} == {"4"}
    assert [t.node_index for t in plan.by_role("teacher")] == [0, 0]  # teachers stay on node 0
    assert [c.role for c in plan.children_for(0, 1)] == ["actor", "actor"]


def test_a_one_rank_plan_is_unchanged_but_for_the_sync_port() -> None:
    plan = place_children(load_run_config(CONFIGS / "local_cpu.yaml"))
    assert [(c.role, c.index, c.port_names) for c in plan.children] == [
        ("actor", 0, ("master", "nccl")), ("teacher", 0, ("http",)), ("teacher", 1, ("http",)),
        ("rollout", 0, ("http", "nccl", "dist_init")),
    ]  # fmt: skip
    # AWEX does not use the torch weight-sync group: rank 0 leases `master` only
    awex = place_children(load_run_config(CONFIGS / "qwen3_coder_4node.yaml", ["weight_sync.backend=awex"]))
    assert awex.by_role("actor")[0].port_names == ("master",)


def test_gpu_groups_keep_one_teacher_child_per_actor_slot() -> None:
    plan = place_children(load_run_config(CONFIGS / "qwen3_coder_4node.yaml"))
    teachers = plan.by_role("teacher")
    assert len(teachers) == len(plan.by_role("actor")) == 32
    assert [t.gpus for t in teachers[:2]] == [("0",), ("1",)]


def test_het_plan_with_two_trainer_nodes(tmp_path: Path) -> None:
    cfg = load_run_config(HET_DP2)
    plan = place_children(cfg)
    assert [(g.name, g.nodes) for g in plan.groups] == [("trainer", 2), ("rollout", 2)]
    assert [(c.role, c.index, c.het_group, c.node_index, c.port_names) for c in plan.children] == [
        ("actor", 0, 0, 0, ("master", "nccl")),
        ("teacher", 0, 0, 0, ("http",)),
        ("teacher", 1, 0, 0, ("http",)),
        ("actor", 1, 0, 1, ()),
        ("rollout", 0, 1, 0, ("http", "nccl", "dist_init")),
        ("rollout", 1, 1, 1, ("http", "nccl", "dist_init")),
    ]
    assert [ranks(a) for a in plan.by_role("actor")] == [("0", "2", "0", "1"), ("1", "2", "0", "1")]
    assert [c.label for c in plan.children_for(0, 1)] == ["actor[1]"]  # the second trainer node's guard
    spec = jobspec_from_config(cfg, tmp_path / "run", sys.executable, plan)
    assert [(c.name, c.nodes, c.cpus_per_task, c.partition) for c in spec.components] == [
        ("trainer", 2, 2, "debug"), ("rollout", 2, 1, "debug"),
    ]  # fmt: skip
    assert spec.components[0].roles == ("actor", "teacher")
    # the local test cluster has 4 nodes of 2 CPUs: the job takes all of them, none asks for more CPUs
    assert sum(c.nodes for c in spec.components) == 4 and max(c.cpus_per_task for c in spec.components) <= 2


def test_rank_map_shows_each_actor_ranks_dp_and_tp() -> None:
    cfg = load_run_config(HET_DP2)
    plan, shape = place_children(cfg), ActorParallel.from_config(cfg)
    rows = rank_map_rows(plan, "torch", shape)
    assert [(r["role"], r["index"], r["dp_rank"], r["tp_rank"], r["broadcast_rank"]) for r in rows] == [
        ("actor", "0", "0", "0", "0 (source)"), ("teacher", "0", "-", "-", "-"), ("teacher", "1", "-", "-", "-"),
        ("actor", "1", "1", "0", "-"), ("rollout", "0", "-", "-", "1"), ("rollout", "1", "-", "-", "2"),
    ]  # fmt: skip
    assert list(rows[0]) == [
        "component", "node", "role", "index", "dp_rank", "tp_rank", "model", "gpus", "ports", "broadcast_rank",
    ]  # fmt: skip
    # a probe plan keeps the ranks of the actors the probes stand in for
    probe = rank_map_rows(plan.as_probe(), "torch", shape)
    assert [(r["role"], r["dp_rank"]) for r in probe][3] == ("actor (probe 3)", "1")
    # without a shape (a plan alone), no such columns
    assert "dp_rank" not in rank_map_rows(plan, "torch")[0]
    console = Console(width=200, record=True, color_system=None)
    print_rank_map(plan, console, "torch", None, shape)
    text = console.export_text()
    header = next(line for line in text.splitlines() if "component" in line)
    assert [c.strip() for c in header.strip("┃").split("┃")][3:6] == ["index", "DP", "TP"]
    assert re.search(r"│ 0:trainer │ 1 +│ actor +│ 1 +│ 1 +│ 0 +│ - +│ cpu +│ -", text)
    assert text.rstrip().splitlines()[-3:] == [
        "actor: world 2 = dp 2 × tp 1 × pp 1 (cluster.trainer.nodes × actor_ranks_per_node = 2 × 1)",
        "teacher chain: 1 replica(s) × tp 1 — replica 0 on trainer node 0 cpu",
        "teacher legs: 1 replica(s) × tp 1 — replica 0 on trainer node 0 cpu",
    ]


def test_rank_map_has_a_pp_column_when_pp_is_above_1() -> None:
    cfg = load_run_config(CONFIGS / "qwen3_coder_4node.yaml", ["models.actor.pipeline_parallel=2"])
    shape = ActorParallel.from_config(cfg)
    actors = [r for r in rank_map_rows(place_children(cfg), "awex", shape) if r["role"] == "actor"]
    # tp 4 innermost, then dp 4, then pp 2: rank 17 = tp 1 + 4·(dp 0 + 4·pp 1)
    assert [(r["index"], r["dp_rank"], r["tp_rank"], r["pp_rank"]) for r in actors][16:18] == [
        ("16", "0", "0", "1"), ("17", "0", "1", "1"),
    ]  # fmt: skip
    assert (actors[5]["dp_rank"], actors[5]["tp_rank"], actors[5]["pp_rank"]) == ("1", "1", "0")
    assert (
        shape_line(shape)
        == "actor: world 32 = dp 4 × tp 4 × pp 2 (cluster.trainer.nodes × gpus_per_node = 4 × 8)"
    )


def test_check_and_dry_run_of_the_dp2_configs() -> None:
    for config, how in [
        (DP2, "cluster.group.nodes × actor_ranks_per_node = 1 × 2"),
        (HET_DP2, "cluster.trainer.nodes × actor_ranks_per_node = 2 × 1"),
    ]:
        rc, out, err = submit_here(str(config), "--check")
        assert (rc, err) == (0, ""), err
        assert out.splitlines()[1] == f"# actor: world 2 = dp 2 × tp 1 × pp 1 ({how})"
        assert not any("not run by the job's roles yet" in line for line in out.splitlines())
        rc, out, err = submit_here(str(config), "--dry-run")
        assert (rc, err) == (0, ""), err
        assert f"actor: world 2 = dp 2 × tp 1 × pp 1 ({how})" in out.splitlines()
        assert out.index("rank map of") < out.index("actor: world 2") < out.index("sbatch --parsable")
