"""Job-level AWEX transfer ranks and the pre-spawn checks (GPU given twice, colocated pairing)."""

from __future__ import annotations

import dataclasses

import pytest

from mopd_hpc.plan.transfer_ranks import (
    ChildPlacement,
    LayoutError,
    RolloutLayout,
    TransferRank,
    assign_transfer_ranks,
    check_transfer_ranks,
)
from mopd_hpc.runtime.topology import RankTopology

EIGHT = tuple(str(i) for i in range(8))


def actor(i: int, host: str, tokens: tuple[str, ...], device: int | None = None) -> ChildPlacement:
    return ChildPlacement("actor", i, host, tokens, device)


def rollout(
    e: int, host: str, tokens: tuple[str, ...], base: int | None = None, node: int = 0
) -> ChildPlacement:
    return ChildPlacement("rollout", e, host, tokens, base, node_rank=node)


def test_separated_ranks_rollout_first_then_trainers() -> None:
    children = [rollout(0, "r1", ("0", "1")), rollout(1, "r1", ("2", "3"))]
    children += [actor(i, "t1", (str(i),)) for i in range(3)]
    layout = assign_transfer_ranks(children, RolloutLayout(num_engines=2, tp=2))
    got = [(r.transfer_rank, r.role, r.child_index, r.rank, r.host, r.device, r.gpu) for r in layout.ranks]
    assert got == [
        (0, "rollout", 0, 0, "r1", 0, "0"),
        (1, "rollout", 0, 1, "r1", 1, "1"),
        (2, "rollout", 1, 0, "r1", 0, "2"),
        (3, "rollout", 1, 1, "r1", 1, "3"),
        (4, "actor", 0, 0, "t1", 0, "0"),
        (5, "actor", 1, 1, "t1", 0, "1"),
        (6, "actor", 2, 2, "t1", 0, "2"),
    ]
    assert (layout.infer_world, layout.train_world, layout.transfer_world) == (4, 3, 7)
    assert [r.transfer_rank for r in layout.for_child("rollout", 1)] == [2, 3]
    assert [r.transfer_rank for r in layout.for_child("actor", 2)] == [6]


def test_four_node_production_shape() -> None:
    # 4 trainer nodes × 8 GPUs (32 actor ranks, one task per GPU, every task sees all 8) and
    # 8 SGLang engines of TP=4 on 4 rollout nodes (two per node, GPUs 0-3 and 4-7).
    children = [actor(8 * n + g, f"t{n}", EIGHT, g) for n in range(4) for g in range(8)]
    children += [rollout(e, f"r{e // 2}", EIGHT[4 * (e % 2) : 4 * (e % 2) + 4]) for e in range(8)]
    children += [ChildPlacement("teacher", i, f"t{i}", EIGHT, 7) for i in range(4)]  # separated: clashes?
    with pytest.raises(
        LayoutError, match=r"GPU '7' on t0 is given to both actor\[7\] on t0 and teacher\[0\]"
    ):
        assign_transfer_ranks(children, RolloutLayout(num_engines=8, tp=4))
    layout = assign_transfer_ranks(children[:40], RolloutLayout(num_engines=8, tp=4))
    assert [r.transfer_rank for r in layout.ranks] == list(range(64))
    assert layout.infer_world == 32 and layout.train_world == 32
    engine5 = layout.for_child("rollout", 5)
    assert [(r.transfer_rank, r.host, r.gpu) for r in engine5] == [
        (20, "r2", "4"),
        (21, "r2", "5"),
        (22, "r2", "6"),
        (23, "r2", "7"),
    ]
    assert layout.for_child("actor", 13)[0].transfer_rank == 32 + 13
    assert layout.for_child("actor", 13)[0].gpu == "5"


def test_colocated_d8t1_pairs_on_host_and_device() -> None:
    children = [actor(i, "n1", EIGHT, i) for i in range(8)]
    children += [rollout(e, "n1", EIGHT, e) for e in range(8)]
    children += [ChildPlacement("teacher", i, "n1", EIGHT, i) for i in range(8)]
    layout = assign_transfer_ranks(children, RolloutLayout(num_engines=8, tp=1), mode="colocated")
    by_device = {}
    for r in layout.ranks:
        by_device.setdefault((r.host, r.device), []).append((r.role, r.transfer_rank))
    assert by_device[("n1", 3)] == [("rollout", 3), ("actor", 11)]
    assert len(by_device) == 8


def test_colocated_pair_with_a_different_gpu_order_is_rejected() -> None:
    children = [actor(i, "n1", ("0", "1"), i) for i in range(2)]
    children += [rollout(e, "n1", ("1", "0"), e) for e in range(2)]
    with pytest.raises(LayoutError) as info:
        assign_transfer_ranks(children, RolloutLayout(num_engines=2), mode="colocated")
    assert "actor[0] and rollout[0]" in str(info.value) and "'0' vs '1'" in str(info.value)


def test_colocated_needs_equal_worlds_and_a_peer_per_rank() -> None:
    children = [actor(i, "n1", EIGHT, i) for i in range(4)] + [rollout(0, "n1", EIGHT[:2])]
    with pytest.raises(LayoutError, match=r"train_world=4 != infer_world=2"):
        assign_transfer_ranks(children, RolloutLayout(num_engines=1, tp=2), mode="colocated")
    children = [actor(0, "n1", ("0",)), actor(1, "n2", ("0",)), rollout(0, "n1", ("0", "1"))]
    with pytest.raises(LayoutError, match=r"actor\[1\] on n2 device 0 .* has no rollout rank"):
        assign_transfer_ranks(children, RolloutLayout(num_engines=1, tp=2), mode="colocated")


def test_separated_mode_rejects_any_shared_gpu() -> None:
    children = [actor(0, "n1", ("GPU-aa",)), rollout(0, "n1", ("GPU-aa",))]
    with pytest.raises(LayoutError) as info:
        assign_transfer_ranks(children, RolloutLayout(num_engines=1))
    message = str(info.value)
    assert "GPU 'GPU-aa' on n1" in message and "actor[0] on n1" in message and "rollout[0] on n1" in message
    assert "separated mode" in message
    # the same tokens on different hosts are different GPUs
    children = [actor(0, "n1", ("0",)), rollout(0, "n2", ("0",))]
    assert assign_transfer_ranks(children, RolloutLayout(num_engines=1)).transfer_world == 2


def test_colocated_mode_rejects_two_children_of_one_role_on_a_gpu() -> None:
    children = [actor(0, "n1", ("0", "1"), 1), actor(1, "n1", ("0", "1"), 1), rollout(0, "n1", ("0", "1"))]
    with pytest.raises(
        LayoutError, match=r"GPU '1' on n1 is given to both actor\[0\] on n1 and actor\[1\] on n1"
    ):
        assign_transfer_ranks(children, RolloutLayout(num_engines=1, tp=2), mode="colocated")


def test_physical_ids_reveal_a_gpu_given_twice_under_renumbering() -> None:
    # two children each see their GPU as "0" (ConstrainDevices), but it is the same physical GPU 3
    a = ChildPlacement("actor", 0, "n1", ("0",), 0, physical_gpus=("3",))
    b = ChildPlacement("rollout", 0, "n1", ("0",), 0, physical_gpus=("3",))
    with pytest.raises(LayoutError, match="GPU '3' on n1"):
        assign_transfer_ranks([a, b], RolloutLayout(num_engines=1))


def test_engine_spanning_two_nodes() -> None:
    children = [
        rollout(0, "r1", ("0", "1"), node=0),
        rollout(0, "r2", ("0", "1"), node=1),
        actor(0, "t1", ("0",)),
    ]
    layout = assign_transfer_ranks(children, RolloutLayout(num_engines=1, tp=4, nodes_per_engine=2))
    assert [(r.transfer_rank, r.rank, r.host, r.device) for r in layout.ranks] == [
        (0, 0, "r1", 0), (1, 1, "r1", 1), (2, 2, "r2", 0), (3, 3, "r2", 1), (4, 0, "t1", 0),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("children", "rollout_layout", "fragment"),
    [
        ([actor(0, "t", ("0",))], RolloutLayout(num_engines=1), "rollout engine 0 node 0 has no child"),
        (
            [rollout(0, "r", ("0",)), rollout(0, "r2", ("1",))],
            RolloutLayout(num_engines=1),
            "two children claim rollout[0]",
        ),
        (
            [rollout(0, "r", ("0",)), rollout(1, "r", ("1",))],
            RolloutLayout(num_engines=1),
            "rollout[1] on r is outside",
        ),
        (
            [rollout(0, "r", ("0",)), actor(1, "t", ("0",))],
            RolloutLayout(num_engines=1),
            "actor indices [1] are not",
        ),
        ([rollout(0, "r", ("0",))], RolloutLayout(num_engines=1, tp=2), "given 1 GPUs"),
        (
            [rollout(0, "r", EIGHT), actor(0, "t", ("0", "1"))],
            RolloutLayout(num_engines=1),
            "names no local_device_index",
        ),
    ],
)
def test_bad_layouts(children: list[ChildPlacement], rollout_layout: RolloutLayout, fragment: str) -> None:
    with pytest.raises(LayoutError) as info:
        assign_transfer_ranks(children, rollout_layout)
    assert fragment in str(info.value)


def test_bad_records_and_mode() -> None:
    with pytest.raises(LayoutError, match="mode='mixed'"):
        assign_transfer_ranks([], RolloutLayout(num_engines=1), mode="mixed")
    with pytest.raises(LayoutError, match="tp=0"):
        RolloutLayout(num_engines=1, tp=0)
    with pytest.raises(LayoutError, match="does not split over nodes_per_engine=2"):
        RolloutLayout(num_engines=1, tp=3, nodes_per_engine=2)
    with pytest.raises(LayoutError, match="lists a GPU twice"):
        ChildPlacement("actor", 0, "n1", ("0", "0"))
    with pytest.raises(LayoutError, match=r"local_device_index=2 not in \[0, 2\)"):
        ChildPlacement("actor", 0, "n1", ("0", "1"), 2)


def test_check_transfer_ranks_duplicates_and_gaps() -> None:
    a = TransferRank(0, "rollout", 0, 0, "r", 0, "0")
    b = TransferRank(0, "actor", 0, 0, "t", 0, "0")
    with pytest.raises(LayoutError, match=r"transfer rank 0 is held by both rollout\[0\] and actor\[0\]"):
        check_transfer_ranks([a, b], 2)
    with pytest.raises(LayoutError, match=r"missing \[1\]"):
        check_transfer_ranks([a, dataclasses.replace(b, transfer_rank=2)], 3)


def test_cpu_job_without_gpus() -> None:
    children = [rollout(0, "n1", ()), actor(0, "n1", ()), actor(1, "n1", ())]
    layout = assign_transfer_ranks(children, RolloutLayout(num_engines=1))
    assert [(r.transfer_rank, r.role, r.device, r.gpu) for r in layout.ranks] == [
        (0, "rollout", None, None), (1, "actor", None, None), (2, "actor", None, None),
    ]  # fmt: skip
    colocated = assign_transfer_ranks(children[:2], RolloutLayout(num_engines=1), mode="colocated")
    assert colocated.transfer_world == 2


def test_placements_from_descriptors() -> None:
    base = {"SLURM_JOB_ID": "5", "SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "2", "SLURMD_NODENAME": "n1"}
    base |= {"SLURM_NODEID": "0", "CUDA_VISIBLE_DEVICES": "0,1"}
    tasks = [
        RankTopology.from_env(base | {"SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)}, role="actor")
        for i in range(2)
    ]
    children = [ChildPlacement.from_topology(t) for t in tasks] + [rollout(0, "n2", ("0",))]
    layout = assign_transfer_ranks(children, RolloutLayout(num_engines=1))
    assert [(r.transfer_rank, r.role, r.host, r.device, r.gpu) for r in layout.ranks] == [
        (0, "rollout", "n2", 0, "0"), (1, "actor", "n1", 0, "0"), (2, "actor", "n1", 1, "1"),
    ]  # fmt: skip


def test_records_are_frozen_with_slots() -> None:
    for record in (
        actor(0, "n", ("0",)),
        RolloutLayout(num_engines=1),
        TransferRank(0, "actor", 0, 0, "n", 0, "0"),
    ):
        assert not hasattr(record, "__dict__")
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(record, dataclasses.fields(record)[0].name, 0)
