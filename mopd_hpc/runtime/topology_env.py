"""Read a task's environment into topology fields: the table of every variable, and the parsers.

`RankTopology.from_env` (topology.py) is the only caller; this module is split out to keep each
one concern: here, which variable means what and how Slurm fills it (launchers.md §2.2/§2.4,
slurm-local-findings.md §4); there, the record and its rules. Nothing here reads `os.environ`.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Any

from mopd_hpc.runtime import child_env
from mopd_hpc.runtime.gpus import GpuTokenError, parse_visible_devices
from mopd_hpc.runtime.hostlist import HostlistError, expand_counts, expand_hostlist

#: Every variable read here: logical key → name (submitit `SlurmJobEnvironment._env` style).
ENV: dict[str, str] = {
    "mopd_backend": child_env.BACKEND,  # "slurm" | "local"
    "mopd_het_group": child_env.HET_GROUP,  # exported by the node launcher: this task's het group
    # Local backend; on Slurm the guard sets them for its children (they override the step's task ranks,
    # which count guards, not children):
    "mopd_rank": child_env.RANK,  # rank within the group (local default 0)
    "mopd_world_size": child_env.WORLD_SIZE,  # world size (local default 1)
    "mopd_local_rank": child_env.LOCAL_RANK,  # rank on this host (local default: MOPD_RANK; Slurm: 0)
    "mopd_local_world_size": child_env.LOCAL_WORLD_SIZE,  # tasks on this host (local default: world)
    "mopd_het_size": child_env.HET_SIZE,  # local backend: number of groups (default 1)
    "mopd_job_id": child_env.JOB_ID,  # local backend: job id (default "local")
    "mopd_hostname": child_env.HOSTNAME,  # local backend: host name (default socket.gethostname())
    "job_id": "SLURM_JOB_ID",  # the het leader's id in every component
    "job_id_legacy": "SLURM_JOBID",
    "het_size": "SLURM_HET_SIZE",
    "het_size_legacy": "SLURM_PACK_SIZE",
    "procid": "SLURM_PROCID",  # step-global rank
    "nodeid": "SLURM_NODEID",  # step-global node index
    "localid": "SLURM_LOCALID",
    "step_tasks": "SLURM_STEP_NUM_TASKS",
    "ntasks": "SLURM_NTASKS",
    "nprocs": "SLURM_NPROCS",
    "step_nodelist": "SLURM_STEP_NODELIST",
    "job_nodelist": "SLURM_JOB_NODELIST",  # plain jobs only
    "nodelist": "SLURM_NODELIST",  # plain jobs only
    "step_tasks_per_node": "SLURM_STEP_TASKS_PER_NODE",
    "tasks_per_node": "SLURM_TASKS_PER_NODE",
    "nodename": "SLURMD_NODENAME",
    "gpus_on_node": "SLURM_GPUS_ON_NODE",
    "step_gpus": "SLURM_STEP_GPUS",
    "job_gpus": "SLURM_JOB_GPUS",
    "visible_devices": "CUDA_VISIBLE_DEVICES",
}
#: Per-het-group variables; `{n}` is the group; Slurm also sets the legacy `_PACK_GROUP_` names.
HET_ENV: dict[str, str] = {
    "job_id": "SLURM_JOB_ID_HET_GROUP_{n}",
    "nodelist": "SLURM_JOB_NODELIST_HET_GROUP_{n}",
    "ntasks": "SLURM_NTASKS_HET_GROUP_{n}",
    "tasks_per_node": "SLURM_TASKS_PER_NODE_HET_GROUP_{n}",
}


class TopologyError(ValueError):
    """The environment is unsupported or contradictory; the message names the variable and value."""


def read_var(env: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    """The first of `names` that is set and non-empty, as (name, value)."""
    for name in names:
        value = env.get(name)
        if value is not None and value.strip():
            return name, value.strip()
    return None


def read_int(env: Mapping[str, str], *names: str, default: int | None = None, minimum: int = 0) -> int | None:
    found = read_var(env, *names)
    if found is None:
        return default
    name, value = found
    if not value.lstrip("-").isdigit() or int(value) < minimum:
        raise TopologyError(f"{name}={value!r}: expected an integer >= {minimum}")
    return int(value)


def _het_var(env: Mapping[str, str], key: str, group: int) -> tuple[str, str] | None:
    template = HET_ENV[key]
    return read_var(
        env, template.format(n=group), template.replace("HET_GROUP", "PACK_GROUP").format(n=group)
    )


def _hosts(name: str, value: str) -> list[str]:
    try:
        return expand_hostlist(value)
    except HostlistError as exc:
        raise TopologyError(f"{name}={value!r}: {exc}") from None


def _counts(name: str, value: str) -> list[int]:
    try:
        return expand_counts(value)
    except HostlistError as exc:
        raise TopologyError(f"{name}={value!r}: {exc}") from None


def read_visible_tokens(env: Mapping[str, str]) -> tuple[str, ...]:
    try:
        return parse_visible_devices(env.get(ENV["visible_devices"]), ENV["visible_devices"])
    except GpuTokenError as exc:
        raise TopologyError(str(exc)) from None


def read_slurm_gpus(env: Mapping[str, str]) -> tuple[str, ...] | None:
    """Global GPU ids of this step on this node; advisory only, so an odd value is ignored."""
    found = read_var(env, ENV["step_gpus"], ENV["job_gpus"])
    if found is None:
        return None
    try:
        return parse_visible_devices(found[1], found[0]) or None
    except GpuTokenError:
        return None


def read_local(env: Mapping[str, str]) -> dict[str, Any]:
    """Local backend: MOPD_* only; SLURM_* (a shell inside an allocation) is ignored on purpose."""
    rank = read_int(env, ENV["mopd_rank"], default=0)
    world = read_int(env, ENV["mopd_world_size"], default=1, minimum=1)
    assert rank is not None and world is not None
    if rank >= world:
        raise TopologyError(f"{child_env.RANK}={rank} is not below {child_env.WORLD_SIZE}={world}")
    het_size = read_int(env, ENV["mopd_het_size"], default=1, minimum=1)
    het_group = read_int(env, ENV["mopd_het_group"], default=0)
    assert het_size is not None and het_group is not None
    if het_group >= het_size:
        raise TopologyError(f"{child_env.HET_GROUP}={het_group} is not below {child_env.HET_SIZE}={het_size}")
    hostname = env.get(ENV["mopd_hostname"]) or socket.gethostname()
    local_rank = read_int(env, ENV["mopd_local_rank"], default=rank)
    return {
        "job_id": env.get(ENV["mopd_job_id"]) or "local",
        "het_group": het_group,
        "het_size": het_size,
        "node_index": 0,
        "node_count": 1,
        "group_hosts": (hostname,),
        "hostname": hostname,
        "rank": rank,
        "world_size": world,
        "local_rank": local_rank,
        "local_world_size": read_int(env, ENV["mopd_local_world_size"], default=world, minimum=1),
    }


def _het_group(
    env: Mapping[str, str], het_size: int, groups: dict[int, tuple[str, list[str]]], hostname: str | None
) -> int:
    """The het group of this task: MOPD_HET_GROUP, else the only group whose nodes hold this host."""
    hint = read_int(env, ENV["mopd_het_group"])
    if hint is not None:
        if hint >= het_size:
            raise TopologyError(
                f"{child_env.HET_GROUP}={hint} is not below SLURM_HET_SIZE={het_size}: the launcher names a het "
                "group this job does not have"
            )
        return hint
    if het_size == 1:
        return 0
    by_host = [n for n, (_, hosts) in groups.items() if hostname in hosts]
    if len(by_host) == 1:
        return by_host[0]
    raise TopologyError(
        f"cannot tell the het group of this task: SLURM_HET_SIZE={het_size}, SLURMD_NODENAME={hostname!r} "
        f"is in the node lists of groups {by_host}; export {child_env.HET_GROUP}=<group> in the step's launcher"
    )


def _check_host(hostname: str | None, group_hosts: list[str], group: int, source: str) -> None:
    if hostname is not None and hostname not in group_hosts:
        raise TopologyError(
            f"SLURMD_NODENAME={hostname!r} is not among the hosts of het group {group} in this step: "
            f"{group_hosts} (from {source}); check {child_env.HET_GROUP}"
        )


def read_slurm(env: Mapping[str, str]) -> dict[str, Any]:
    """Slurm backend: a task of a step, plain or heterogeneous (launchers.md §2, findings §4)."""
    found_job = read_var(env, ENV["job_id"], ENV["job_id_legacy"], HET_ENV["job_id"].format(n=0))
    if found_job is None:
        raise TopologyError(
            "SLURM_JOB_ID is not set: not inside a Slurm job; use the local backend "
            f"({child_env.BACKEND}=local, or mopd-debug topology --local)"
        )
    procid = read_int(env, ENV["procid"])
    if procid is None:
        raise TopologyError(
            "SLURM_PROCID is not set: this is not a task of a Slurm step (a shell in an allocation?); run it "
            f"under srun, or use the local backend ({child_env.BACKEND}=local, or mopd-debug topology --local)"
        )
    nodeid = read_int(env, ENV["nodeid"])
    local_rank = read_int(env, ENV["localid"], default=0)
    het_size = read_int(env, ENV["het_size"], ENV["het_size_legacy"], default=1, minimum=1)
    assert local_rank is not None and het_size is not None
    hostname = env.get(ENV["nodename"]) or None
    groups: dict[int, tuple[str, list[str]]] = {}
    for n in range(het_size):
        found = _het_var(env, "nodelist", n)
        if found is not None:
            groups[n] = (found[0], _hosts(*found))
    plain = (ENV["job_nodelist"], ENV["nodelist"]) if het_size == 1 else ()
    found_step = read_var(env, ENV["step_nodelist"], *plain)
    step_var, step_hosts = (found_step[0], _hosts(*found_step)) if found_step else ("", [])
    group = _het_group(env, het_size, groups, hostname)
    group_var, group_list = groups.get(group, (step_var, step_hosts))
    if not step_hosts:
        step_var, step_hosts = group_var, group_list
    if not step_hosts:
        raise TopologyError(
            f"no node list: none of {ENV['step_nodelist']}, {ENV['job_nodelist']}, "
            f"{HET_ENV['nodelist'].format(n=group)} is set; run inside a Slurm step"
        )
    step_world = read_int(env, ENV["step_tasks"], ENV["ntasks"], ENV["nprocs"], minimum=1)
    multi_group = any(h not in group_list for h in step_hosts)
    if not multi_group:
        group_hosts = step_hosts
        _check_host(hostname, group_hosts, group, group_var or step_var)
        rank, node_offset = procid, 0
        counts_found = read_var(env, ENV["step_tasks_per_node"], ENV["tasks_per_node"])
        world = step_world
        if world is None:
            world = sum(_counts(*counts_found)) if counts_found else 1
        if rank >= world:
            raise TopologyError(
                f"SLURM_PROCID={procid} is not below the step's {world} tasks "
                f"(SLURM_STEP_NUM_TASKS / SLURM_NTASKS)"
            )
    else:
        group_hosts = [h for h in group_list if h in step_hosts]
        if not group_hosts:
            raise TopologyError(
                f"het group {group} has no host in this step: {group_var} lists {group_list}, "
                f"{step_var} lists {step_hosts}; check {child_env.HET_GROUP}"
            )
        _check_host(hostname, group_hosts, group, group_var)
        in_step = [n for n, (_, hosts) in groups.items() if set(hosts) & set(step_hosts)]
        tasks: dict[int, int] = {}
        for n in in_step:
            found = _het_var(env, "ntasks", n)
            if found is None:
                raise TopologyError(
                    f"{HET_ENV['ntasks'].format(n=n)} is not set; it is needed to rebase "
                    f"SLURM_PROCID={procid} in a step spanning het groups {in_step}"
                )
            tasks[n] = read_int(env, found[0], minimum=1) or 1
        if step_world is not None and sum(tasks.values()) != step_world:
            raise TopologyError(
                f"cannot rebase SLURM_PROCID={procid}: the step runs {step_world} tasks (SLURM_NTASKS) but its "
                f"het groups {in_step} were allocated {tasks} tasks; start one srun per het group or keep each "
                "group's allocated task count"
            )
        earlier = [n for n in in_step if n < group]
        task_offset = sum(tasks[n] for n in earlier)
        node_offset = sum(len([h for h in groups[n][1] if h in step_hosts]) for n in earlier)
        rank, world = procid - task_offset, tasks[group]
        counts_found = _het_var(env, "tasks_per_node", group)
        if not 0 <= rank < world:
            raise TopologyError(
                f"SLURM_PROCID={procid} minus the {task_offset} tasks of earlier het groups {earlier} gives rank "
                f"{rank}, not in [0, {world}) for het group {group} ({HET_ENV['ntasks'].format(n=group)}={world}); "
                f"check {child_env.HET_GROUP}"
            )
    if hostname is not None:
        node_index = group_hosts.index(hostname)
    elif nodeid is not None and 0 <= nodeid - node_offset < len(group_hosts):
        node_index = nodeid - node_offset
    elif len(group_hosts) == 1:
        node_index = 0
    else:
        raise TopologyError(
            f"SLURM_NODEID={nodeid} does not place this task among {group_hosts} "
            "and SLURMD_NODENAME is not set"
        )
    per_node = _counts(*counts_found) if counts_found else None
    if per_node is not None and len(per_node) != len(group_hosts):
        raise TopologyError(
            f"{counts_found[0]}={counts_found[1]!r} gives {len(per_node)} nodes, but het group "
            f"{group} runs on {len(group_hosts)} nodes in this step: {group_hosts}"
        )
    if per_node is not None:
        tasks_on_node: int | None = per_node[node_index]
    else:
        tasks_on_node = world // len(group_hosts) if world % len(group_hosts) == 0 else None
    if tasks_on_node is not None and local_rank >= tasks_on_node:
        raise TopologyError(
            f"SLURM_LOCALID={local_rank} is not below the {tasks_on_node} tasks of het group "
            f"{group} on {group_hosts[node_index]!r}"
        )
    if read_var(env, ENV["mopd_rank"]) is not None:
        rank, world, local_rank, tasks_on_node = _guard_child_ranks(env)
    return {
        "job_id": found_job[1],
        "het_group": group,
        "het_size": het_size,
        "node_index": node_index,
        "node_count": len(group_hosts),
        "group_hosts": tuple(group_hosts),
        "hostname": group_hosts[node_index],
        "rank": rank,
        "world_size": world,
        "local_rank": local_rank,
        "local_world_size": tasks_on_node,
    }


def guard_child(env: Mapping[str, str]) -> bool:
    """True when a guard started this process on Slurm and named its ranks (MOPD_RANK is set)."""
    return read_var(env, ENV["mopd_rank"]) is not None


def _guard_child_ranks(env: Mapping[str, str]) -> tuple[int, int, int, int | None]:
    """(rank, world, local_rank, local_world_size) a guard gave its child; they replace SLURM_PROCID & co."""
    rank = read_int(env, ENV["mopd_rank"], default=0)
    world = read_int(env, ENV["mopd_world_size"], minimum=1)
    if world is None:
        raise TopologyError(
            f"{child_env.RANK}={rank} is set but {child_env.WORLD_SIZE} is not: a guard names both for its children"
        )
    assert rank is not None
    if rank >= world:
        raise TopologyError(f"{child_env.RANK}={rank} is not below {child_env.WORLD_SIZE}={world}")
    local_rank = read_int(env, ENV["mopd_local_rank"], default=0)
    assert local_rank is not None
    return rank, world, local_rank, read_int(env, ENV["mopd_local_world_size"], minimum=1)
