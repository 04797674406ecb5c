"""The actor group's shape (issue 16, config side): `ActorParallel` derives world = the trainer slots, dp = world /
(tp·pp), and each rank's (dp, pp, tp) coordinates in megatron-core's order (checked against megatron's own
RankGenerator); the config refuses shapes that do not divide and `actor_ranks_per_node` where it means
nothing, naming the fields; a CPU torch actor at DP > 1 runs, torch on several GPUs and megatron beyond one
process are job gaps; too many CPU ranks for a node's CPUs warn."""

from __future__ import annotations

from pathlib import Path

import pytest

from mopd_hpc.config import ConfigError, load_run_config
from mopd_hpc.config.job_gaps import job_gaps
from mopd_hpc.config.parallel import ActorParallel, ParallelError, RankCoords, actor_world
from mopd_hpc.plan.placement import place_children

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
LOCAL = CONFIGS / "local_cpu.yaml"
SLURM_GPUS = [
    "cluster.backend=slurm", "models.actor.engine=megatron", "weight_sync.backend=torch",
    "models.actor.optimizer.schedule=constant", "models.actor.optimizer.warmup_ratio=0",
    "loss.estimator=sampled",  # the megatron engine's estimator (config/capabilities.py)
]  # fmt: skip


def problems(config: Path, *overrides: str) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_run_config(config, list(overrides))
    return {p.path: p.render() for p in info.value.problems}


# --- the world and the sizes -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "overrides", "sizes", "how"),
    [
        ("local_cpu.yaml", [], (1, 1, 1, 1), "cluster.group.nodes × actor_ranks_per_node = 1 × 1"),
        ("local_cpu_dp2.yaml", [], (2, 2, 1, 1), "cluster.group.nodes × actor_ranks_per_node = 1 × 2"),
        (
            "local_cpu.yaml",
            ["cluster.group.nodes=3", "cluster.group.actor_ranks_per_node=2"],
            (6, 6, 1, 1),
            "cluster.group.nodes × actor_ranks_per_node = 3 × 2",
        ),
        ("slurm_het_cpu_dp2.yaml", [], (2, 2, 1, 1), "cluster.trainer.nodes × actor_ranks_per_node = 2 × 1"),
        ("qwen3_coder_4node.yaml", [], (32, 8, 4, 1), "cluster.trainer.nodes × gpus_per_node = 4 × 8"),
        (
            "qwen3_coder_4node.yaml",
            ["models.actor.pipeline_parallel=2"],
            (32, 4, 4, 2),
            "cluster.trainer.nodes × gpus_per_node = 4 × 8",
        ),
        (
            "local_gpu_separated.yaml",
            [],
            (1, 1, 1, 1),
            "cluster.group.nodes × gpus_per_node = 1 × 2 − rollout.engines count·tensor_parallel 1·1",
        ),
    ],
)
def test_world_is_the_trainer_slots_and_dp_the_rest(
    config: str, overrides: list[str], sizes: tuple[int, int, int, int], how: str
) -> None:
    cfg = load_run_config(CONFIGS / config, overrides)
    shape = ActorParallel.from_config(cfg)
    assert (shape.world, shape.dp, shape.tp, shape.pp) == sizes
    assert shape.source == how == actor_world(cfg.cluster, cfg.rollout).how
    # the placement lays out exactly that world: one actor child per rank, each told the world size
    actors = place_children(cfg).by_role("actor")
    assert (
        [a.index for a in actors]
        == list(range(shape.world))
        == [int(a.env_dict["MOPD_RANK"]) for a in actors]
    )
    assert {a.env_dict["MOPD_WORLD_SIZE"] for a in actors} == {str(shape.world)}


def test_every_shipped_config_places_its_actor_world() -> None:
    for path in sorted(CONFIGS.glob("*.yaml")):
        cfg = load_run_config(path)
        plan = place_children(cfg)
        assert len(plan.by_role("actor")) == ActorParallel.from_config(cfg).world == plan.train_world, path


def test_coords_follow_megatron_order_tp_innermost() -> None:
    """The reference: megatron-core's RankGenerator with its default order 'tp-cp-ep-dp-pp'."""
    parallel_state = pytest.importorskip("megatron.core.parallel_state")
    for tp, dp, pp in [(1, 2, 1), (2, 3, 2), (4, 2, 1), (1, 1, 3), (2, 1, 2)]:
        shape = ActorParallel.from_sizes(tp * dp * pp, tp, pp)
        assert shape.dp == dp
        ref = parallel_state.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
        ours = {
            "dp": sorted({shape.dp_peers(r) for r in range(shape.world)}),
            "tp": sorted({shape.tp_peers(r) for r in range(shape.world)}),
        }
        assert ours["dp"] == sorted(tuple(g) for g in ref.get_ranks("dp")), (tp, dp, pp)
        assert ours["tp"] == sorted(tuple(g) for g in ref.get_ranks("tp")), (tp, dp, pp)
        for pp_rank, group in enumerate(zip(*ref.get_ranks("pp"), strict=True)):  # stage s: group[s]
            assert {shape.pp_rank(r) for r in group} == {pp_rank}
        for r in range(shape.world):
            c = shape.coords(r)
            assert shape.rank(dp=c.dp, pp=c.pp, tp=c.tp) == r
            assert shape.dp_peers(r)[c.dp] == r and shape.tp_peers(r)[c.tp] == r


def test_coords_of_a_dp2_tp2_world() -> None:
    shape = ActorParallel.from_sizes(4, tp=2)
    assert [shape.coords(r) for r in range(4)] == [
        RankCoords(dp=0, pp=0, tp=0), RankCoords(dp=0, pp=0, tp=1),
        RankCoords(dp=1, pp=0, tp=0), RankCoords(dp=1, pp=0, tp=1),
    ]  # fmt: skip
    assert [shape.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [shape.tp_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert shape.dp_peers(1) == (1, 3) and shape.tp_peers(3) == (2, 3)
    assert shape.describe() == "world 4 = dp 2 × tp 2 × pp 1"


def test_sizes_that_do_not_multiply_to_the_world_are_refused() -> None:
    with pytest.raises(ParallelError) as info:
        ActorParallel.from_sizes(4, tp=3, source="cluster.group.nodes × gpus_per_node = 1 × 4")
    assert str(info.value) == (
        "dp · tp(3) · pp(1) != world(4) for any whole dp: models.actor.tensor_parallel · pipeline_parallel = 3 "
        "must divide the actor's world 4 (cluster.group.nodes × gpus_per_node = 1 × 4); choose "
        "tensor_parallel·pipeline_parallel among 1, 2 or 4, or change the trainer slots"
    )
    with pytest.raises(ParallelError, match=r"^dp\(2\) · tp\(3\) · pp\(1\) != world\(4\): the sizes must"):
        ActorParallel(world=4, dp=2, tp=3, pp=1)
    with pytest.raises(ParallelError, match=r"^actor parallel tp=0: expected an integer >= 1"):
        ActorParallel(world=4, dp=4, tp=0, pp=1)
    with pytest.raises(ParallelError, match=r"^the actor's world is 0"):
        ActorParallel.from_sizes(0)
    shape = ActorParallel.from_sizes(2)
    with pytest.raises(ParallelError, match=r"^actor rank 2: expected an integer in \[0, world=2\)"):
        shape.coords(2)
    with pytest.raises(ParallelError, match=r"^tp rank 1: expected in \[0, tp size 1\)"):
        shape.rank(dp=0, tp=1)


# --- config problems: shapes that do not divide, actor_ranks_per_node where it means nothing ----------------


def test_tp_pp_not_dividing_the_actor_world_names_the_fields() -> None:
    got = problems(
        LOCAL, *SLURM_GPUS, "cluster.group.gpus_per_node=6",
        "models.actor.tensor_parallel=2", "models.actor.pipeline_parallel=2",
    )  # fmt: skip
    assert got["models.actor"] == (
        "models.actor: tensor_parallel·pipeline_parallel = 2·2 = 4 must divide the GPUs of cluster.group "
        "(6 = nodes·gpus_per_node): dp · tp(2) · pp(2) != world(6) for any whole dp: "
        "models.actor.tensor_parallel · pipeline_parallel = 4 must divide the actor's world 6 "
        "(cluster.group.nodes × gpus_per_node = 1 × 6) (got 4; tensor_parallel·pipeline_parallel among "
        "1, 2, 3 or 6, or change the trainer slots)"
    )
    # the same sizes on 2 nodes of 6 GPUs: world 12 = dp 3 × tp 2 × pp 2
    cfg = load_run_config(
        LOCAL, [*SLURM_GPUS, "cluster.group.gpus_per_node=6", "cluster.group.nodes=2",
                "models.actor.tensor_parallel=2", "models.actor.pipeline_parallel=2"],
    )  # fmt: skip
    assert ActorParallel.from_config(cfg).describe() == "world 12 = dp 3 × tp 2 × pp 2"


def test_tp_or_pp_on_cpu_ranks_is_refused() -> None:
    got = problems(LOCAL, "cluster.group.actor_ranks_per_node=2", "models.actor.tensor_parallel=2")
    assert got["models.actor.tensor_parallel"].startswith(
        "models.actor.tensor_parallel: tensor parallelism needs GPUs, but cluster.group.gpus_per_node is 0"
    )


@pytest.mark.parametrize(
    ("overrides", "path", "expected"),
    [
        (
            [
                "cluster.backend=slurm",
                "cluster.group.gpus_per_node=2",
                "cluster.group.actor_ranks_per_node=2",
            ],
            "cluster.group.actor_ranks_per_node",
            "cluster.group.actor_ranks_per_node: on a group with GPUs the actor's ranks are its GPUs "
            "(group.gpus_per_node is 2: one rank per GPU) (got 2; null (or 1); more ranks need more GPUs per "
            "node, or gpus_per_node: 0 for CPU ranks)",
        ),
        (
            ["cluster.rollout.actor_ranks_per_node=2"],
            "cluster.rollout.actor_ranks_per_node",
            "cluster.rollout.actor_ranks_per_node: the rollout group holds no actor rank (got 2; null; set it "
            "on cluster.trainer (the group of the actor))",
        ),
    ],
)
def test_actor_ranks_per_node_only_on_the_cpu_group_of_the_actor(
    overrides: list[str], path: str, expected: str
) -> None:
    config = LOCAL if overrides[0].startswith("cluster.backend") else CONFIGS / "slurm_het_cpu.yaml"
    assert problems(config, *overrides) == {path: expected}


def test_actor_ranks_per_node_null_or_1_is_fine_anywhere() -> None:
    gpu = load_run_config(
        LOCAL,
        ["cluster.backend=slurm", "cluster.group.gpus_per_node=2", "cluster.group.actor_ranks_per_node=1"],
    )
    assert gpu.cluster.group.actor_slots_per_node == 2  # one rank per GPU
    het = load_run_config(CONFIGS / "slurm_het_cpu.yaml", ["cluster.rollout.actor_ranks_per_node=1"])
    assert het.cluster.rollout.actor_slots_per_node == 1
    assert load_run_config(LOCAL).cluster.group.actor_ranks_per_node is None
    assert problems(LOCAL, "cluster.group.actor_ranks_per_node=0")["cluster.group.actor_ranks_per_node"] == (
        "cluster.group.actor_ranks_per_node: must be greater than or equal to 1 (got 0)"
    )


def test_more_cpu_ranks_than_cpus_warns() -> None:
    cfg = load_run_config(LOCAL, ["cluster.group.actor_ranks_per_node=3"])
    assert (
        "cluster.group.actor_ranks_per_node: 3 actor ranks train at the same time on each node's 2 CPU(s) "
        "(cluster.group.cpus_per_task): more threads than cores slow every step (got 3; at most 2, or "
        "cpus_per_task ≥ 3)"
    ) in cfg.warnings()
    assert not any(
        "actor_ranks_per_node" in w for w in load_run_config(CONFIGS / "local_cpu_dp2.yaml").warnings()
    )


# --- what runs: CPU data parallelism; gaps for what has not run ---------------------------------------------


def test_cpu_torch_dp_runs_gpu_torch_and_megatron_beyond_one_process_are_gaps() -> None:
    for config in ("local_cpu_dp2.yaml", "slurm_het_cpu_dp2.yaml"):
        assert job_gaps(load_run_config(CONFIGS / config)) == []
    megatron = load_run_config(
        LOCAL, [*SLURM_GPUS, "cluster.group.gpus_per_node=4", "weight_sync.backend=ipc"]
    )
    assert [g.render() for g in job_gaps(megatron)] == [
        "models.actor.engine: the actor role runs the megatron engine at data-parallel size ≤ 1 on GPUs: the "
        "actor has 4 trainer ranks (cluster.group.nodes × gpus_per_node = 1 × 4), dp 4 = world / "
        "(tensor_parallel·pipeline_parallel); more has not run yet: tests/engines/test_megatron_actor_group_gpu.py "
        "(2 GPUs) (got 'megatron'; one trainer slot (cluster.group.nodes × "
        "gpus_per_node), or engine: torch on CPU ranks, or allow_unverified: true (--allow-unverified) to run "
        "it unverified)"
    ]
    staged = load_run_config(
        LOCAL,
        [
            *SLURM_GPUS,
            "cluster.group.gpus_per_node=2",
            "models.actor.pipeline_parallel=2",
            "weight_sync.backend=ipc",
        ],
    )
    assert [(g.path, g.got) for g in job_gaps(staged)] == [("models.actor.pipeline_parallel", 2)]  # dp 1
    torch_gpus = load_run_config(
        LOCAL, ["cluster.backend=slurm", "cluster.group.nodes=2", "cluster.group.gpus_per_node=1"]
    )
    # and the torch broadcast cannot join the colocated rollout on an actor's GPU (NCCL: one rank per GPU)
    gap, sync = job_gaps(torch_gpus)
    assert sync.path == "weight_sync.backend"
    assert (
        gap.path == "models.actor.engine" and "(cluster.group.nodes × gpus_per_node = 2 × 1)" in gap.render()
    )
