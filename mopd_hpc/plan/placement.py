"""Lay a RunConfig out into a `JobPlan`: which child runs on which node of which het group, with which GPUs.

Rules (DESIGN.md §1, §4; config rules in `config/rules.py` already hold when this runs):

- GPUs of a group are numbered node by node: slot (node, gpu). Without GPUs a group has one CPU slot per
  node, and the actor `actor_ranks_per_node` of them (null = 1) on each node of its group.
- **actor**: one child per trainer slot (its trainer rank: MOPD_RANK, MOPD_WORLD_SIZE, MOPD_LOCAL_RANK,
  MOPD_LOCAL_WORLD_SIZE), the slots of the trainer group (`config/parallel.py` actor_world; a rank's DP/TP
  ranks are `ActorParallel.from_config(cfg).coords(rank)`, not in the env); in the colocated shape with
  `rollout.mode: separated`, the last `count·tp` GPUs go to the rollout engines and the actor gets the rest.
  Rank 0 gets the `master` port (the actor group's torch.distributed rendezvous) and, with
  `weight_sync.backend: torch`, the `nccl` port (the weight-sync group's store, trainer → rollout engines).
- **teacher**: for each teacher (none when loss.distillation_coefficient is 0: ExecutionPlan), R replicas
  (`config/parallel.py teacher_replicas`: `models.teachers[i].replicas`, null = the actor's GPUs ÷ its
  tensor_parallel on GPUs, 1 on CPU), each a scoring server of its own. On a GPU group replica r takes the
  actor slots [r·tp, (r+1)·tp) (the actor's GPUs: the phase machine time-slices them, DESIGN.md §3): one
  child per GPU, MOPD_RANK / MOPD_WORLD_SIZE its rank in the replica's tensor-parallel group; rank 0 (the
  leader) serves `http`, and with tp > 1 leases `master` (the group's rendezvous). On a CPU group one
  child per replica (tp is 1 there), replica r on node r mod nodes, serving `http`. Every teacher child
  carries MOPD_TEACHER_ID and MOPD_TEACHER_REPLICA; indices count on over the teachers in config order.
- **rollout**: engine e takes GPUs [e·tp, (e+1)·tp) of the rollout group (an engine never spans nodes:
  tp divides gpus_per_node); without GPUs engines go round-robin over the nodes. Ports http, nccl,
  dist_init (SGLang's --port, --nccl-port, --dist-init-addr).
- **GPU visibility**: in `separated` mode a child sees only its own GPUs; in `colocated` mode every child
  sees all GPUs of its node and `device_index` says where it starts (AWEX's colocate reader pairs trainer
  and rollout ranks on the same device ordinal).
- Transfer ranks come from `plan.transfer_ranks.assign_transfer_ranks`; its colocated (node, device) pairing
  is checked for `weight_sync.backend: awex` only (torch.distributed sync has no such need).
- No GPU is given to two children that run at the same time, checked here on the GPUs each child computes
  on (`ChildSpec.compute_gpus`): teachers share GPUs with the actor (and in colocated mode every role with
  the others) by design, never with another rank of the same teacher; children of one role never share.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from mopd_hpc.config.parallel import ActorParallel, ParallelError, teacher_replicas
from mopd_hpc.plan.transfer_ranks import LayoutError, assign_transfer_ranks
from mopd_hpc.runtime import child_env
from mopd_hpc.runtime.plan import ChildSpec, GroupPlan, JobPlan, PlanError

#: Named ports per role (DESIGN.md §4: ports are named, never positional).
ROLLOUT_PORTS = ("http", "nccl", "dist_init")
#: Actor rank 0: the actor group's rendezvous; `nccl`: the torch weight-sync group's store.
ACTOR_MASTER_PORTS = ("master",)
ACTOR_SYNC_PORTS = ("nccl",)
ROLE_ORDER = {"actor": 0, "teacher": 1, "rollout": 2, "probe": 3}

Slot = tuple[int, int | None]  # (node index, GPU ordinal or None on CPU)


def _slots(nodes: int, gpus_per_node: int, cpu_slots_per_node: int = 1) -> list[Slot]:
    if gpus_per_node == 0:
        return [(n, None) for n in range(nodes) for _ in range(cpu_slots_per_node)]
    return [(n, g) for n in range(nodes) for g in range(gpus_per_node)]


def _rank_env(rank: int, world: int, local_rank: int, local_world: int) -> dict[str, str]:
    return {
        child_env.RANK: str(rank),
        child_env.WORLD_SIZE: str(world),
        child_env.LOCAL_RANK: str(local_rank),
        child_env.LOCAL_WORLD_SIZE: str(local_world),
    }


def _local_ranks(nodes: list[int]) -> list[tuple[int, int]]:
    """(local rank, local world) of each item, given the node of each item."""
    per_node = Counter(nodes)
    seen: Counter[int] = Counter()
    out = []
    for node in nodes:
        out.append((seen[node], per_node[node]))
        seen[node] += 1
    return out


def _visibility(
    slot_gpus: list[int | None], gpus_per_node: int, colocated: bool
) -> tuple[list[str], int | None]:
    """(CUDA_VISIBLE_DEVICES ordinals, device_index) of a child working on `slot_gpus` of one node."""
    if slot_gpus[0] is None:
        return [], None
    if colocated:
        return [str(g) for g in range(gpus_per_node)], slot_gpus[0]
    return [str(g) for g in slot_gpus], None


def _child(
    role: str,
    index: int,
    het_group: int,
    node: int,
    slot_gpus: list[int | None],
    gpus_per_node: int,
    colocated: bool,
    ports: tuple[str, ...],
    env: dict[str, str],
) -> ChildSpec:
    """The child of `role`[index] on node `node` of het group `het_group`, working on `slot_gpus` of that node
    (`[None]` on a CPU group), with its GPU visibility (`_visibility`), named ports and env."""
    gpus, device = _visibility(slot_gpus, gpus_per_node, colocated)
    return ChildSpec.create(
        role=role, index=index, het_group=het_group, node_index=node, gpus=gpus, device_index=device,
        port_names=ports, env=env,
    )  # fmt: skip


def place_children(cfg: Any) -> JobPlan:
    """The JobPlan of a validated RunConfig.

    Raises:
        PlanError: the layout breaks a rule (the actor's sizes do not divide its slots, a teacher's
            tensor-parallel size does not divide the actor's ranks, transfer ranks not dense, a GPU given to
            two children that run at the same time, ...).
    """
    cluster, rollout = cfg.cluster, cfg.rollout
    het = cluster.shape == "heterogeneous"
    colocated = rollout.mode == "colocated"
    groups = tuple(
        GroupPlan(name, i, g.nodes, g.gpus_per_node) for i, (name, g) in enumerate(cluster.groups().items())
    )
    trainer_hg, rollout_hg = 0, (1 if het else 0)
    tg, rg = cluster.trainer_group, cluster.rollout_group
    count, tp = rollout.engines.count, rollout.engines.tensor_parallel
    rollout_slots = _slots(rg.nodes, rg.gpus_per_node)
    actor_slots = _slots(tg.nodes, tg.gpus_per_node, tg.actor_slots_per_node)
    if rg.gpus_per_node:
        need = count * tp
        split = not het and not colocated  # one group: rollout takes its last GPUs, the actor the rest
        rollout_slots = rollout_slots[len(rollout_slots) - need :] if split else rollout_slots[:need]
        if split:
            actor_slots = actor_slots[: len(actor_slots) - need]
        engines = [rollout_slots[e * tp : (e + 1) * tp] for e in range(count)]
    else:
        engines = [[rollout_slots[e % len(rollout_slots)]] for e in range(count)]
    children: list[ChildSpec] = []
    world = len(actor_slots)
    try:
        shape = ActorParallel.from_config(cfg)
    except ParallelError as exc:
        raise PlanError(f"the actor group: {exc}") from None
    if shape.world != world:  # config/parallel.py actor_world counts the slots laid out here
        raise PlanError(f"the actor has {world} trainer slots here but {shape.describe()} ({shape.source})")
    actor_local = _local_ranks([n for n, _ in actor_slots])
    rank0_ports = ACTOR_MASTER_PORTS + (ACTOR_SYNC_PORTS if cfg.weight_sync.backend == "torch" else ())
    for rank, ((node, gpu), (lr, lw)) in enumerate(zip(actor_slots, actor_local, strict=True)):
        ports = rank0_ports if rank == 0 else ()
        env = _rank_env(rank, world, lr, lw)
        children.append(
            _child("actor", rank, trainer_hg, node, [gpu], tg.gpus_per_node, colocated, ports, env)
        )
    teachers = cfg.models.teachers if cfg.loss.distillation_coefficient > 0 else []
    if not tg.gpus_per_node:
        children += _cpu_teachers(cfg, teachers, trainer_hg, tg.nodes)
        teachers = []
    index = 0
    for k, teacher in enumerate(teachers):
        ttp, replicas = teacher.tensor_parallel, teacher_replicas(cfg, teacher)
        if teacher.replicas is None and world % ttp:
            raise PlanError(
                f"models.teachers[{k}] ({teacher.id!r}): tensor_parallel={ttp} does not divide the actor's "
                f"{world} ranks, whose GPUs the teacher shares; choose a divisor of {world}, or set replicas"
            )
        if replicas * ttp > world:
            raise PlanError(
                f"models.teachers[{k}] ({teacher.id!r}): replicas·tensor_parallel = {replicas}·{ttp} exceeds the "
                f"actor's {world} GPUs, which the teacher's replicas share; at most {world // ttp} replica(s)"
            )
        for r in range(replicas):
            for q, (node, gpu) in enumerate(actor_slots[r * ttp : (r + 1) * ttp]):
                ports = (("http", "master") if ttp > 1 else ("http",)) if q == 0 else ()
                env = {**_rank_env(q, ttp, q, ttp), **_teacher_env(teacher.id, r)}
                children.append(
                    _child("teacher", index, trainer_hg, node, [gpu], tg.gpus_per_node, colocated, ports, env)
                )
                index += 1
    engine_local = _local_ranks([engine[0][0] for engine in engines])
    for e, (engine, (lr, lw)) in enumerate(zip(engines, engine_local, strict=True)):
        if len({n for n, _ in engine}) != 1:
            raise PlanError(f"rollout engine {e} would span nodes {sorted({n for n, _ in engine})}")
        env = {**_rank_env(e, count, lr, lw), child_env.ROLLOUT_TP: str(tp)}
        slot_gpus = [g for _, g in engine]
        children.append(
            _child(
                "rollout",
                e,
                rollout_hg,
                engine[0][0],
                slot_gpus,
                rg.gpus_per_node,
                colocated,
                ROLLOUT_PORTS,
                env,
            )
        )
    children = _with_transfer_ranks(children, count, tp, cfg.weight_sync.backend == "awex", rollout.mode)
    check_gpu_sharing(children, rollout.mode, tp)
    children.sort(key=lambda c: (c.het_group, c.node_index, ROLE_ORDER[c.role], c.index))
    return JobPlan(
        name=cfg.name,
        shape=cluster.shape,
        mode=rollout.mode,
        groups=groups,
        children=tuple(children),
        infer_world=count * tp,
        train_world=world,
    )


def _teacher_env(teacher_id: str, replica: int) -> dict[str, str]:
    return {child_env.TEACHER_ID: teacher_id, child_env.TEACHER_REPLICA: str(replica)}


def _cpu_teachers(cfg: Any, teachers: Any, het_group: int, nodes: int) -> list[ChildSpec]:
    """One child per replica of each teacher on a CPU trainer group (rank 0 of 1, `http`), replica r on node
    r mod nodes; indices count on over the teachers."""
    out: list[ChildSpec] = []
    for teacher in teachers:
        for r in range(teacher_replicas(cfg, teacher)):
            env = {**_rank_env(0, 1, 0, 1), **_teacher_env(teacher.id, r)}
            out.append(_child("teacher", len(out), het_group, r % nodes, [None], 0, False, ("http",), env))
    return out


def _with_transfer_ranks(
    children: list[ChildSpec], count: int, tp: int, awex: bool, mode: str
) -> list[ChildSpec]:
    """Children with their AWEX transfer ranks (`plan/transfer_ranks.py`); LayoutError becomes PlanError."""
    try:
        layout = assign_transfer_ranks(children, count, tp, pair_colocated=awex and mode == "colocated")
    except LayoutError as exc:
        raise PlanError(f"job layout: {exc}") from None
    out = []
    for child in children:
        ranks = tuple(r.transfer_rank for r in layout.for_child(child.role, child.index))
        out.append(ChildSpec.create(**{**child.to_dict(), "transfer_ranks": ranks}))
    return out


def check_gpu_sharing(children: list[ChildSpec], mode: str, tp: int) -> None:
    """No GPU given to two children that run at the same time (DESIGN.md §4), teachers included: children
    of one role (one teacher id) never share; actor and teachers share by design; in colocated mode
    every role shares with the others."""
    owners: dict[tuple[int, int, str], list[ChildSpec]] = {}
    for child in children:
        for gpu in child.compute_gpus(tp):
            key = (child.het_group, child.node_index, gpu)
            for other in owners.get(key, []):
                same = other.role == child.role and (
                    child.role != "teacher"
                    or other.env_dict.get(child_env.TEACHER_ID) == child.env_dict.get(child_env.TEACHER_ID)
                )
                by_design = mode == "colocated" or {other.role, child.role} <= {"actor", "teacher"}
                if same or not by_design:
                    raise PlanError(
                        f"GPU {gpu} of het group {key[0]} node {key[1]} is given to both {other.label} and "
                        f"{child.label}, which run at the same time ({mode} mode); give each its own GPU"
                    )
            owners.setdefault(key, []).append(child)
