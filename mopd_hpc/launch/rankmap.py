"""The dry-run rank map: one row per planned child (component, node, role, index, model (a teacher's id and
replica),
GPUs, named ports and the child's place in the weight sync), as `mopd-submit --dry-run` prints it. Ports are leased when the guard
starts the child: the map names them, 'assigned at start'.

Given the actor's parallel shape (`config/parallel.py` ActorParallel, from the config), each actor row shows
its DP and TP ranks (and its PP rank when pp > 1; "-" for the other roles), and `print_rank_map` prints the
shape under the table ("actor: world 2 = dp 2 × tp 1 × pp 1 (how the world was counted)").

The weight-sync column follows `weight_sync.backend`: for `awex`, each child's AWEX transfer ranks (the title
gives the AWEX mode and world sizes); for `torch`, each child's rank in the broadcast group of
`engines/weight_sync/torch.py` (trainer rank 0 is the source, rank 0; rollout engine i joins as rank 1 + i).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from mopd_hpc.config.parallel import ActorParallel
from mopd_hpc.records.run_dir import PROBE_DIR
from mopd_hpc.runtime import child_env
from mopd_hpc.runtime.plan import ChildSpec, JobPlan

#: What the ports column says about port numbers before the job runs.
PORTS_NOTE = "assigned at start"
#: weight_sync.backend values the rank map knows (config/rollout.py WeightSyncConfig.backend).
SYNC_BACKENDS = ("awex", "torch", "ipc")


def compact_ranges(values: Sequence[int]) -> str:
    """`[0, 1, 2, 3, 8]` → `"0-3,8"`; `[]` → `"-"`."""
    if not values:
        return "-"
    out, start, prev = [], values[0], values[0]
    for v in [*values[1:], None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        out.append(f"{start}-{prev}" if prev > start else str(start))
        if v is not None:
            start = prev = v
    return ",".join(out)


def ipc_cell(role: str, index: int) -> str:
    """A child's part in the ipc weight sync (engines/weight_sync/ipc.py): trainer rank 0 owns the shared
    buffer ("buffer (source)"), every rollout engine maps it ("reader"); "-" for the others."""
    if role == "actor" and index == 0:
        return "buffer (source)"
    return "reader" if role == "rollout" else "-"


def broadcast_rank(role: str, index: int) -> int | None:
    """A child's rank in the torch weight-sync broadcast group (engines/weight_sync/torch.py): trainer rank 0
    (`actor` index 0) is the source, rank 0; rollout engine i is rank 1 + i; every other child is outside it
    (None)."""
    if role == "actor" and index == 0:
        return 0
    if role == "rollout":
        return 1 + index
    return None


def _sync_column(role: str, index: int, child: ChildSpec, backend: str) -> tuple[str, str]:
    """(row key, cell) of the weight-sync column of one child."""
    if backend == "awex":
        return "transfer_rank", compact_ranges(child.transfer_ranks)
    if backend == "ipc":  # engines/weight_sync/ipc.py: trainer rank 0 shares its buffer with every engine
        shared = (
            {0: "buffer (source)"}.get(index, "-")
            if role == "actor"
            else "reader"
            if role == "rollout"
            else "-"
        )
        return "ipc", shared
    rank = broadcast_rank(role, index)
    if rank is None:
        return "broadcast_rank", "-"
    return "broadcast_rank", "0 (source)" if rank == 0 else str(rank)


def model_cell(role: str, env: dict[str, str]) -> str:
    """The model column of one child: a teacher's model id (MOPD_TEACHER_ID, set by the plan) and its replica
    (MOPD_TEACHER_REPLICA: "chain r1" is replica 1), with its rank in the replica's tensor-parallel group when
    the replica spans several GPUs ("chain r0, tp 1/2"); "-" for other roles."""
    teacher = env.get(child_env.TEACHER_ID)
    if role != "teacher" or not teacher:
        return "-"
    replica = env.get(child_env.TEACHER_REPLICA)
    cell = teacher if replica is None else f"{teacher} r{replica}"
    world = env.get(child_env.WORLD_SIZE, "1")
    return f"{cell}, tp {env.get(child_env.RANK, '0')}/{world}" if world not in ("", "1") else cell


def _check_backend(backend: str) -> None:
    if backend not in SYNC_BACKENDS:
        raise ValueError(f"weight_sync backend={backend!r}: expected one of {SYNC_BACKENDS}")


def parallel_cells(role: str, index: int, parallel: ActorParallel) -> dict[str, str]:
    """The DP/TP (and PP, when pp > 1) cells of one child: an actor's ranks in `parallel`, "-" otherwise.
    Keys `dp_rank`, `tp_rank` (, `pp_rank`). Raises ParallelError for an actor index outside the world."""
    keys = ("dp_rank", "tp_rank", "pp_rank") if parallel.pp > 1 else ("dp_rank", "tp_rank")
    if role != "actor":
        return dict.fromkeys(keys, "-")
    c = parallel.coords(index)
    return {k: str(v) for k, v in zip(keys, (c.dp, c.tp, c.pp), strict=False)}


def rank_map_rows(
    plan: JobPlan, sync_backend: str = "awex", parallel: ActorParallel | None = None
) -> list[dict[str, str]]:
    """The rows of the rank map as strings (the table's columns), one per child, in plan order. `model` is a
    teacher's model id (`model_cell`), "-" for other roles.

    Args:
        parallel: the actor's shape (`ActorParallel.from_config(cfg)`): adds `dp_rank`, `tp_rank` (and
            `pp_rank` when pp > 1) after `index` (`parallel_cells`); None: no such columns (a plan alone).
        sync_backend: `weight_sync.backend`. "awex": the last column is `transfer_rank` (the child's AWEX
            transfer ranks, compacted: "4-7"); "torch": it is `broadcast_rank` (trainer rank 0: "0 (source)",
            rollout engine i: "1 + i", others "-"); "ipc": it is `ipc` (trainer rank 0: "buffer (source)",
            every rollout engine: "reader", others "-"). Raises ValueError for any other value.
    """
    _check_backend(sync_backend)
    rows = []
    for child in plan.children:
        group = plan.groups[child.het_group]
        gpus = ",".join(child.gpus) if child.gpus else "cpu"
        if child.device_index is not None:
            gpus += f" (from {child.gpus[child.device_index]})"
        env = child.env_dict
        role, index = child.role, child.index
        shown_role, shown_index = role, str(index)
        if child_env.PLAN_ROLE in env:  # a probe standing in for another role: show what it stands for
            role, index = env[child_env.PLAN_ROLE], int(env[child_env.PLAN_INDEX])
            shown_role, shown_index = f"{role} (probe {child.index})", str(index)
        key, cell = _sync_column(role, index, child, sync_backend)
        rows.append(
            {
                "component": f"{child.het_group}:{group.name}",
                "node": str(child.node_index),
                "role": shown_role,
                "index": shown_index,
                **(parallel_cells(role, index, parallel) if parallel else {}),
                "model": model_cell(role, env),
                "gpus": gpus,
                "ports": f"{', '.join(child.port_names)} ({PORTS_NOTE})" if child.port_names else "-",
                key: cell,
            }
        )
    return rows


def rank_map_table(
    plan: JobPlan,
    sync_backend: str = "awex",
    awex_mode: str | None = None,
    parallel: ActorParallel | None = None,
) -> Table:
    """A rich Table of `rank_map_rows(plan, sync_backend, parallel)` with a title giving the weight-sync world:
    for awex its mode (`awex_mode`, when given) and infer + train world; for torch the broadcast source and
    group size. With `parallel`, columns "DP", "TP" (and "PP" when pp > 1) after "index": each actor's ranks.
    """
    _check_backend(sync_backend)
    if sync_backend == "awex":
        sync = f"AWEX infer world {plan.infer_world} + train world {plan.train_world} = {plan.transfer_world}"
        sync += f" (awex_mode {awex_mode})" if awex_mode else ""
        column = "AWEX transfer rank"
    elif sync_backend == "ipc":
        sync = "ipc: trainer rank 0's shared buffer, mapped by every rollout engine on its node"
        column = "ipc shared buffer"
    else:
        engines = {
            int(c.env_dict.get(child_env.PLAN_INDEX, c.index))
            for c in plan.children
            if c.env_dict.get(child_env.PLAN_ROLE, c.role) == "rollout"
        }
        n = len(engines)
        sync = f"torch broadcast world 1 + {n} = {1 + n} (trainer rank 0 to {n} rollout engine(s))"
        column = "torch broadcast rank"
    title = (
        f"rank map of {plan.name!r}: {len(plan.children)} children"
        f"{' (probe-only: every child runs the probe role)' if plan.probe else ''}; {sync}"
    )
    table = Table(title=title, title_justify="left")
    ranks = () if parallel is None else ("DP", "TP", "PP")[: 3 if parallel.pp > 1 else 2]
    headers = ("component", "node", "role", "index", *ranks, "model", "GPUs", "named ports", column)
    for header in headers:
        table.add_column(header, overflow="fold")
    for row in rank_map_rows(plan, sync_backend, parallel):
        table.add_row(*row.values())
    return table


def shape_line(parallel: ActorParallel) -> str:
    """'actor: world 2 = dp 2 × tp 1 × pp 1 (cluster.group.nodes × actor_ranks_per_node = 1 × 2)'."""
    return f"actor: {parallel.describe()}" + (f" ({parallel.source})" if parallel.source else "")


def teacher_lines(plan: JobPlan) -> list[str]:
    """One line per teacher of `plan`: its replicas and the GPUs each computes on, e.g. "teacher chain: 2
    replica(s) × tp 1 — replica 0 on node 0 GPU 0, replica 1 on node 0 GPU 1" (CPU: "on node 0 cpu")."""
    found: dict[str, dict[int, list[str]]] = {}
    for child in plan.children:
        env = child.env_dict
        if child.role != "teacher" or child_env.TEACHER_ID not in env:
            continue
        replica = int(env.get(child_env.TEACHER_REPLICA, "0"))
        gpu = next(iter(child.compute_gpus()), None)
        where = f"GPU {gpu}" if gpu is not None else "cpu"
        found.setdefault(env[child_env.TEACHER_ID], {}).setdefault(replica, []).append(
            f"{child.het_group}:{child.node_index}:{where}"
        )
    lines = []
    for teacher, replicas in found.items():
        tp = max(len(v) for v in replicas.values())
        parts = []
        for r, places in sorted(replicas.items()):
            nodes = sorted({p.split(":")[1] for p in places})
            gpus = [p.split(":", 2)[2] for p in places]
            shown = gpus[0] if len(gpus) == 1 else "GPUs " + ",".join(g.removeprefix("GPU ") for g in gpus)
            parts.append(f"replica {r} on node {','.join(nodes)} {shown}")
        lines.append(f"teacher {teacher}: {len(replicas)} replica(s) × tp {tp} — " + "; ".join(parts))
    return lines


def print_rank_map(
    plan: JobPlan,
    console: Console,
    sync_backend: str = "awex",
    awex_mode: str | None = None,
    parallel: ActorParallel | None = None,
) -> None:
    """Print `rank_map_table`, then `shape_line(parallel)` (when given) and `teacher_lines(plan)`; callers with a config pass
    `cfg.weight_sync.backend`, `.awex_mode` and `ActorParallel.from_config(cfg)`."""
    console.print(rank_map_table(plan, sync_backend, awex_mode, parallel))
    if parallel is not None:
        console.print(shape_line(parallel), markup=False, highlight=False)
    for line in teacher_lines(plan):
        console.print(line, markup=False, highlight=False)


def read_probe_reports(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every probe report under run_dir/probe/ (written by `mopd_hpc.roles.probe`), sorted by index."""
    reports = []
    for path in sorted(Path(run_dir, PROBE_DIR).glob("*.json")):
        try:
            reports.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    return sorted(reports, key=lambda r: (r.get("role", ""), r.get("index", 0)))


def _probe_gpus(topology: dict[str, Any]) -> str:
    """The GPUs cell of a probe report, as the rank map's: the child's CUDA_VISIBLE_DEVICES tokens and, when
    it uses one of them, "(from <token>)"; "cpu" without GPUs."""
    tokens = [str(t) for t in topology.get("gpu_tokens") or ()]
    if not tokens:
        return "cpu"
    device = topology.get("local_device_index")
    used = f" (from {tokens[device]})" if isinstance(device, int) and 0 <= device < len(tokens) else ""
    return ",".join(tokens) + used


def probe_report_table(reports: Sequence[dict[str, Any]], sync_backend: str | None = None) -> Table:
    """What the probes reported: host, het group/node, the role stood in for (with a teacher's model id),
    rank/world, local rank, GPUs (the child's CUDA_VISIBLE_DEVICES tokens), ports, the weight-sync rank, and
    the restart count.

    The weight-sync column is the dry-run rank map's (`rank_map_rows`) for the job's `weight_sync.backend`:
    `sync_backend`, else the backend the reports name (`weight_sync_backend`, from the run config), else
    "awex". For torch it is the broadcast rank (trainer rank 0: "0 (source)", rollout engine i: 1 + i); for
    awex, the AWEX transfer ranks. Raises ValueError for an unknown backend.
    """
    if sync_backend is None:
        named = {r.get("weight_sync_backend") for r in reports} - {None}
        sync_backend = named.pop() if len(named) == 1 else "awex"
    _check_backend(sync_backend)
    column = {"awex": "AWEX transfer rank", "ipc": "ipc shared buffer"}.get(
        sync_backend, "torch broadcast rank"
    )
    table = Table(title=f"what the {len(reports)} probe(s) reported", title_justify="left")
    for header in (
        "host",
        "het group",
        "node",
        "role",
        "model",
        "rank/world",
        "local",
        "GPUs",
        "ports",
        column,
        "restart",
    ):
        table.add_column(header, overflow="fold")
    for r in reports:
        topo = r.get("topology", {})
        role, index = (
            (r["plan_role"], r.get("plan_index") or 0) if r.get("plan_role") else (r["role"], r["index"])
        )
        if sync_backend == "awex":
            sync = compact_ranges(r.get("transfer_ranks", []))
        elif sync_backend == "ipc":
            sync = ipc_cell(role, int(index))
        else:
            rank = broadcast_rank(role, int(index))
            sync = "-" if rank is None else "0 (source)" if rank == 0 else str(rank)
        table.add_row(
            str(r.get("host")),
            f"{topo.get('het_group')}/{topo.get('het_size')}",
            f"{topo.get('node_index')}/{topo.get('node_count')}",
            f"{role}[{index}]",
            model_cell(role, r.get("env") or {}),
            f"{topo.get('rank')}/{topo.get('world_size')}",
            f"{topo.get('local_rank')}/{topo.get('local_world_size')}",
            _probe_gpus(topo),
            ", ".join(f"{k}={v}" for k, v in sorted(r.get("ports", {}).items())) or "-",
            sync,
            str(r.get("restart_count")),
        )
    return table
