"""The job plan's AWEX transfer ranks (`plan/transfer_ranks.py`), the colocated pairing, and the placement's check
that no GPU goes to two children that run at the same time — all on the GPUs `ChildSpec.compute_gpus` names."""

from __future__ import annotations

import dataclasses

import pytest

from mopd_hpc.plan.placement import check_gpu_sharing
from mopd_hpc.plan.transfer_ranks import JobLayout, LayoutError, TransferRank, assign_transfer_ranks
from mopd_hpc.runtime import child_env
from mopd_hpc.runtime.plan import ChildSpec, PlanError

EIGHT = tuple(str(i) for i in range(8))


def actor(i: int, node: int, gpus: tuple[str, ...], device: int | None = None, group: int = 0) -> ChildSpec:
    return ChildSpec.create(
        role="actor", index=i, het_group=group, node_index=node, gpus=gpus, device_index=device
    )


def rollout(e: int, node: int, gpus: tuple[str, ...], base: int | None = None, group: int = 0) -> ChildSpec:
    return ChildSpec.create(
        role="rollout", index=e, het_group=group, node_index=node, gpus=gpus, device_index=base
    )


def teacher(i: int, node: int, gpus: tuple[str, ...], device: int | None, teacher_id: str) -> ChildSpec:
    return ChildSpec.create(
        role="teacher", index=i, het_group=0, node_index=node, gpus=gpus, device_index=device,
        env={child_env.TEACHER_ID: teacher_id},
    )  # fmt: skip


def rows(layout: JobLayout) -> list[tuple[int, str, int, int, int, int | None, str | None]]:
    return [
        (r.transfer_rank, r.role, r.child_index, r.rank, r.node_index, r.device, r.gpu) for r in layout.ranks
    ]


def test_separated_ranks_rollout_first_then_trainers() -> None:
    children = [rollout(0, 1, ("0", "1")), rollout(1, 1, ("2", "3"))]
    children += [actor(i, 0, (str(i),)) for i in range(3)]
    layout = assign_transfer_ranks(children, num_engines=2, tp=2)
    assert rows(layout) == [
        (0, "rollout", 0, 0, 1, 0, "0"),
        (1, "rollout", 0, 1, 1, 1, "1"),
        (2, "rollout", 1, 0, 1, 0, "2"),
        (3, "rollout", 1, 1, 1, 1, "3"),
        (4, "actor", 0, 0, 0, 0, "0"),
        (5, "actor", 1, 1, 0, 0, "1"),
        (6, "actor", 2, 2, 0, 0, "2"),
    ]
    assert (layout.infer_world, layout.train_world, layout.transfer_world) == (4, 3, 7)
    assert [r.transfer_rank for r in layout.for_child("rollout", 1)] == [2, 3]
    assert [r.transfer_rank for r in layout.for_child("actor", 2)] == [6]


def test_four_node_production_shape() -> None:
    # 4 trainer nodes × 8 GPUs (32 actor ranks, one per GPU, every one sees all 8) and 8 engines of TP=4 on 4
    # rollout nodes of het group 1 (two per node, GPUs 0-3 and 4-7); teachers are passed over
    children = [actor(8 * n + g, n, EIGHT, g) for n in range(4) for g in range(8)]
    children += [rollout(e, e // 2, EIGHT[4 * (e % 2) : 4 * (e % 2) + 4], group=1) for e in range(8)]
    children += [teacher(i, i, EIGHT, 7, "t") for i in range(4)]
    layout = assign_transfer_ranks(children, num_engines=8, tp=4)
    assert [r.transfer_rank for r in layout.ranks] == list(range(64))
    assert layout.infer_world == 32 and layout.train_world == 32
    engine5 = layout.for_child("rollout", 5)
    assert [(r.transfer_rank, r.het_group, r.node_index, r.gpu) for r in engine5] == [
        (20, 1, 2, "4"),
        (21, 1, 2, "5"),
        (22, 1, 2, "6"),
        (23, 1, 2, "7"),
    ]
    assert layout.for_child("actor", 13)[0].transfer_rank == 32 + 13
    assert (layout.for_child("actor", 13)[0].device, layout.for_child("actor", 13)[0].gpu) == (5, "5")


def test_colocated_d8t1_pairs_on_node_and_device() -> None:
    children = [actor(i, 0, EIGHT, i) for i in range(8)] + [rollout(e, 0, EIGHT, e) for e in range(8)]
    layout = assign_transfer_ranks(children, num_engines=8, tp=1, pair_colocated=True)
    by_device: dict[tuple[int, int | None], list[tuple[str, int]]] = {}
    for r in layout.ranks:
        by_device.setdefault((r.node_index, r.device), []).append((r.role, r.transfer_rank))
    assert by_device[(0, 3)] == [("rollout", 3), ("actor", 11)]
    assert len(by_device) == 8


def test_a_child_without_device_index_computes_on_its_first_gpu() -> None:
    # the one rule (ChildSpec.compute_gpus): device_index None = the first visible GPU, for every role
    children = [actor(0, 0, ("2", "3")), rollout(0, 0, ("2", "3"))]
    layout = assign_transfer_ranks(children, num_engines=1, tp=1, pair_colocated=True)
    assert rows(layout) == [(0, "rollout", 0, 0, 0, 0, "2"), (1, "actor", 0, 0, 0, 0, "2")]


def test_colocated_pair_with_a_different_gpu_order_is_rejected() -> None:
    children = [actor(i, 0, ("0", "1"), i) for i in range(2)] + [
        rollout(e, 0, ("1", "0"), e) for e in range(2)
    ]
    with pytest.raises(LayoutError) as info:
        assign_transfer_ranks(children, num_engines=2, pair_colocated=True)
    assert "actor[0] and rollout[0]" in str(info.value) and "'0' vs '1'" in str(info.value)
    assert assign_transfer_ranks(children, num_engines=2).transfer_world == 4  # unpaired: no such need


def test_colocated_needs_equal_worlds_and_a_peer_per_rank() -> None:
    children = [actor(i, 0, EIGHT, i) for i in range(4)] + [rollout(0, 0, EIGHT[:2])]
    with pytest.raises(LayoutError, match=r"train_world=4 != infer_world=2"):
        assign_transfer_ranks(children, num_engines=1, tp=2, pair_colocated=True)
    children = [actor(0, 0, ("0",)), actor(1, 1, ("0",)), rollout(0, 0, ("0", "1"))]
    with pytest.raises(
        LayoutError, match=r"actor\[1\] on het group 0 node 1 device 0 .* has no rollout rank"
    ):
        assign_transfer_ranks(children, num_engines=1, tp=2, pair_colocated=True)


@pytest.mark.parametrize(
    ("children", "engines", "tp", "fragment"),
    [
        ([actor(0, 0, ("0",))], 1, 1, "rollout engine 0 has no child"),
        ([rollout(0, 0, ("0",)), rollout(0, 1, ("1",))], 1, 1, "two children claim rollout[0]"),
        (
            [rollout(0, 0, ("0",)), rollout(1, 0, ("1",))],
            1,
            1,
            "rollout[1] is outside the rollout fleet of 1",
        ),
        ([rollout(0, 0, ("0",)), actor(1, 0, ("0",))], 1, 1, "actor indices [1] are not"),
        ([rollout(0, 0, ("0",))], 1, 2, "given 1 GPUs ('0',); give it tp GPUs"),
        ([rollout(0, 0, ("0", "1"), 1)], 1, 2, "runs 2 ranks from device 1"),
        ([], 0, 1, "num_engines=0"),
    ],
)
def test_bad_layouts(children: list[ChildSpec], engines: int, tp: int, fragment: str) -> None:
    with pytest.raises(LayoutError) as info:
        assign_transfer_ranks(children, num_engines=engines, tp=tp)
    assert fragment in str(info.value)


def test_cpu_job_without_gpus() -> None:
    children = [rollout(0, 0, ()), actor(0, 0, ()), actor(1, 0, ())]
    layout = assign_transfer_ranks(children, num_engines=1)
    assert [(r.transfer_rank, r.role, r.device, r.gpu) for r in layout.ranks] == [
        (0, "rollout", None, None), (1, "actor", None, None), (2, "actor", None, None),
    ]  # fmt: skip
    colocated = assign_transfer_ranks(children[:2], num_engines=1, pair_colocated=True)
    assert colocated.transfer_world == 2


def test_no_gpu_goes_to_two_children_that_run_at_once() -> None:
    # separated: actor and rollout never share; the same ordinal on another node is another GPU
    with pytest.raises(PlanError) as info:
        check_gpu_sharing([actor(0, 0, ("3",)), rollout(0, 0, ("3",))], "separated", 1)
    message = str(info.value)
    assert "GPU 3 of het group 0 node 0 is given to both actor[0] and rollout[0]" in message
    assert "(separated mode)" in message
    check_gpu_sharing([actor(0, 0, ("0",)), rollout(0, 1, ("0",))], "separated", 1)
    # colocated: every role shares, two of one role never; what counts is the GPU each computes on
    with pytest.raises(
        PlanError, match=r"GPU 1 of het group 0 node 0 is given to both actor\[0\] and actor\[1\]"
    ):
        check_gpu_sharing([actor(0, 0, ("0", "1"), 1), actor(1, 0, ("0", "1"), 1)], "colocated", 1)
    check_gpu_sharing(
        [actor(0, 0, ("0", "1")), actor(1, 0, ("0", "1"), 1), rollout(0, 0, ("0", "1"))], "colocated", 2
    )
    # a rollout engine computes on tp GPUs from its device: engine 1 from GPU 1 at tp 2 overlaps engine 0
    with pytest.raises(PlanError, match=r"GPU 1 .* rollout\[0\] and rollout\[1\]"):
        check_gpu_sharing([rollout(0, 0, EIGHT[:4]), rollout(1, 0, EIGHT[:4], 1)], "colocated", 2)
    # teachers share the actor's GPU by design, never another rank of the same teacher
    shared = [actor(0, 0, ("0",)), teacher(0, 0, ("0",), None, "a"), teacher(1, 0, ("0",), None, "b")]
    check_gpu_sharing(shared, "separated", 1)
    with pytest.raises(PlanError, match=r"teacher\[0\] and teacher\[1\]"):
        check_gpu_sharing(
            [teacher(0, 0, ("0",), None, "a"), teacher(1, 0, ("0",), None, "a")], "separated", 1
        )


def test_records_are_frozen_with_slots() -> None:
    for record in (
        TransferRank(0, "actor", 0, 0, 0, 0, 0, "0"),
        JobLayout(infer_world=1, train_world=1, ranks=()),
    ):
        assert not hasattr(record, "__dict__")
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(record, dataclasses.fields(record)[0].name, 0)
