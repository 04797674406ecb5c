"""Guard autostart (`mopd-guard --plan run_dir/plan.json`): spawn this node's children, exit when they are done.

The guard finds its place from its own environment (`RankTopology.from_env`: het group and node index on
Slurm; the local backend runs every child of the plan on this machine), leases each child's named ports,
maps the plan's GPU ordinals onto the GPUs it sees, and spawns the children with the plan's environment
(`runtime.plan.child_environment`). Then it waits:

- every child exited 0 → teardown, exit 0;
- one child failed (non-zero exit or a signal) → kill the rest at once (no checkpoint wait), exit with
  that child's code (128 + signal number for a signal): the step fails and the batch watchdog ends the job;
- the guard was signalled → the normal teardown; exit 0 for Slurm's USR2/TERM (a requested stop: the batch
  shell decides about requeue, and srun reports a step's highest task code, so a TERM'd guard must not hide
  the code of the node that failed first), 128 + 2 for SIGINT (Ctrl-C).

It writes `run_dir/ports/<host>.json` (each child's role, index and leased ports) once all are spawned,
for rendezvous (e.g. the actor's `master` port) and for `mopd-debug`.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mopd_hpc.atomic import atomic_write_json
from mopd_hpc.records.run_dir import ports_record_file
from mopd_hpc.runtime.gpus import GpuTokenError, parse_visible_devices
from mopd_hpc.runtime.guard.children import Child
from mopd_hpc.runtime.guard.roles import RoleModuleMissingError, UnregisteredRoleError
from mopd_hpc.runtime.guard.server import Guard
from mopd_hpc.runtime.guard.spawn_env import ChildEnvError
from mopd_hpc.runtime.plan import ChildSpec, JobPlan, PlanError, child_environment
from mopd_hpc.runtime.ports import PortLeaseError, PortOwner
from mopd_hpc.runtime.topology import RankTopology

log = logging.getLogger("mopd_hpc.guard")

#: Exit code when a child of the plan could not be spawned (role module missing, no port, fork failed).
EXIT_PLAN_SPAWN_FAILED = 4
#: Period of the children's exit poll, seconds.
_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class NodeAssignment:
    """What one guard runs: its children, with the backend and het size they are told."""

    backend: str
    het_group: int
    node_index: int
    het_size: int
    children: tuple[ChildSpec, ...]


def assign_node(plan: JobPlan, env: Mapping[str, str]) -> NodeAssignment:
    """This guard's children, from its environment (read at the edge and passed in).

    Raises:
        TopologyError: the environment gives no valid topology.
        PlanError: the allocation does not match the plan (het groups, node count).
    """
    topo = RankTopology.from_env(env)
    if topo.backend == "local":  # one guard, this machine: every child of the plan
        return NodeAssignment("local", 0, 0, plan.het_size, plan.children)
    if topo.het_size != plan.het_size:
        raise PlanError(
            f"the job has {topo.het_size} het group(s) (SLURM_HET_SIZE) but the plan {plan.name!r} has "
            f"{plan.het_size}: submit the plan's own script"
        )
    group = plan.groups[topo.het_group]
    if topo.node_count != group.nodes:
        raise PlanError(
            f"het group {topo.het_group} ({group.name}) runs on {topo.node_count} node(s) {topo.group_hosts} "
            f"but the plan expects {group.nodes}"
        )
    children = plan.children_for(topo.het_group, topo.node_index)
    return NodeAssignment("slurm", topo.het_group, topo.node_index, plan.het_size, children)


def map_gpus(child: ChildSpec, visible: Sequence[str]) -> list[str]:
    """The child's GPU tokens: the plan's node ordinals looked up in the guard's visible GPUs.

    Raises:
        PlanError: the plan gives the child a GPU ordinal this node does not have.
    """
    out = []
    for ordinal in child.gpus:
        i = int(ordinal)
        if i >= len(visible):
            raise PlanError(
                f"{child.label} is planned on GPU {i} of its node, but the guard sees {len(visible)} GPU(s) "
                f"(CUDA_VISIBLE_DEVICES={','.join(visible)!r}); check cluster.<group>.gpus_per_node"
            )
        out.append(visible[i])
    return out


def visible_gpus(env: Mapping[str, str]) -> tuple[str, ...]:
    """The guard's GPU tokens (CUDA_VISIBLE_DEVICES, as Slurm gave them). Raises PlanError when malformed."""
    try:
        return parse_visible_devices(env.get("CUDA_VISIBLE_DEVICES"))
    except GpuTokenError as exc:
        raise PlanError(str(exc)) from None


async def run_plan(guard: Guard, assignment: NodeAssignment, visible: Sequence[str]) -> int:
    """Spawn `assignment.children` on `guard` (started), wait as the module docstring says, tear down.

    Returns:
        the guard's exit code (0, the first failing child's code, 130 after SIGINT, EXIT_PLAN_SPAWN_FAILED).
    """
    spawned: list[Child] = []
    events = guard.events
    events.emit(
        "plan_start",
        children=len(assignment.children),
        het_group=assignment.het_group,
        node_index=assignment.node_index,
        backend=assignment.backend,
    )
    await guard.children.forks.prepare({spec.role for spec in assignment.children})
    for spec in assignment.children:
        try:
            module = guard.config.roles.module_for(spec.role)
            gpus = map_gpus(spec, visible)
            owner = PortOwner.create(guard.config.job_id, spec.role, spec.index)
            generation = guard.children.next_generation(spec.role, spec.index)
            leases = guard.leaser.reserve(owner, spec.port_names, generation) if spec.port_names else {}
            env = child_environment(spec, assignment.backend, assignment.het_size)
            child = guard.children.spawn(spec.role, spec.index, module, env, gpus, leases)
        except (
            UnregisteredRoleError,
            RoleModuleMissingError,
            PlanError,
            PortLeaseError,
            ChildEnvError,
            OSError,
        ) as exc:
            log.error("guard: cannot spawn %s: %s", spec.label, exc)
            events.emit(
                "plan_spawn_failed", role=spec.role, index=spec.index, error=f"{type(exc).__name__}: {exc}"
            )
            guard.start_teardown(checkpoint=False)
            await guard.wait_teardown()
            return EXIT_PLAN_SPAWN_FAILED
        guard.leaser.note_child(owner, child.pid, child.generation)
        spawned.append(child)
    _write_ports(guard, assignment, spawned)
    rc = await _watch(guard, spawned)
    events.emit("plan_done", exit_code=rc)
    guard.start_teardown(checkpoint=False)
    await guard.wait_teardown()
    return rc


async def _watch(guard: Guard, children: list[Child]) -> int:
    while True:
        if guard.stopping:
            return 128 + guard.stop_signal if guard.stop_signal == signal.SIGINT else 0
        failed = [c for c in children if c.exited.is_set() and (c.exit_code != 0)]
        if failed:
            first = min(failed, key=lambda c: c.ended_ts or 0.0)
            code = first.exit_code if first.exit_code is not None else 128 + _signum(first.signal)
            log.error(
                "guard: %s[%d] failed (%s): stopping this node's children",
                first.role,
                first.index,
                first.signal or f"exit code {first.exit_code}",
            )
            guard.events.emit(
                "plan_failed",
                role=first.role,
                index=first.index,
                exit_code=first.exit_code,
                signal=first.signal,
                code=code,
            )
            return code
        if all(c.exited.is_set() for c in children):
            return 0
        await asyncio.sleep(_POLL_S)


def _signum(name: str | None) -> int:
    try:
        return int(signal.Signals[name or ""])
    except KeyError:
        return int(signal.SIGKILL)


def _write_ports(guard: Guard, assignment: NodeAssignment, children: list[Child]) -> None:
    cfg = guard.config
    ports_record_file(cfg.run_dir, cfg.host).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(
        ports_record_file(cfg.run_dir, cfg.host),
        {
            "host": cfg.host,
            "het_group": assignment.het_group,
            "node_index": assignment.node_index,
            "children": [
                {"role": c.role, "index": c.index, "pid": c.pid, "ports": c.ports} for c in children
            ],
        },
    )
