"""The job plan: every child of the job, where it runs and what it gets, decided before anything starts.

`plan.placement.place_children(cfg)` lays a RunConfig out into a `JobPlan`: one `ChildSpec` per process a guard
will spawn: its role and index, its het group and node index *within the group* (hosts are not known
before the allocation), its GPUs (ordinals into the node's GPUs, as strings; the guard maps them to the
tokens it sees), its named ports (leased at start), its rank environment (MOPD_RANK, MOPD_WORLD_SIZE,
MOPD_LOCAL_RANK, MOPD_LOCAL_WORLD_SIZE: what `RankTopology.from_env` takes a guard child's ranks from)
and its AWEX transfer ranks. `mopd-submit` writes it atomically to `run_dir/plan.json` before submission;
each guard (`mopd-guard --plan`) spawns the children of its (het group, node index).

`plan.as_probe()` replaces every child's role by `probe` (same placement, GPUs, ports and transfer ranks;
the original role and index travel as MOPD_PLAN_ROLE / MOPD_PLAN_INDEX): a dry run of the whole job.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mopd_hpc.atomic import atomic_write_text
from mopd_hpc.runtime import child_env
from mopd_hpc.runtime.topology import ROLES

#: Version of plan.json; bumped when a key changes meaning.
PLAN_VERSION = 1
#: Role that stands in for every role of a probe-only plan.
PROBE_ROLE = "probe"
#: Keys the guard sets itself for every child (`child_env.GUARD_KEYS`); a plan may not set them.
GUARD_SET_KEYS = frozenset(child_env.GUARD_KEYS)
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_PORT_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


class PlanError(ValueError):
    """The job cannot be laid out, or a plan record is malformed; the message names the child and field."""


@dataclass(frozen=True, slots=True)
class ChildSpec:
    """One child process of the job, as a guard will spawn it. Build with `ChildSpec.create`.

    Attributes:
        role: "actor", "teacher", "rollout" or "probe".
        index: the child's index within its role on the job (actor: trainer rank; rollout: engine rank;
            teacher: teacher ordinal · world + rank; probe-only plans: the child's position in the plan).
        het_group: the het group (Slurm job component) it runs in.
        node_index: the node within its het group, 0-based.
        gpus: CUDA_VISIBLE_DEVICES of the child as ordinals into the node's GPUs ("0".."G-1"); () = CPU.
        device_index: the device ordinal (into `gpus`) it works on first: the actor's device, a rollout
            engine's base_gpu_id; None = its only or first device.
        port_names: named ports leased for it at start (`http`, `nccl`, `dist_init`, `master`).
        env: extra environment, sorted (key, value) pairs: the rank variables and role specifics.
        transfer_ranks: its AWEX transfer ranks (one per actor, tp·pp per rollout engine; () otherwise).
    """

    role: str
    index: int
    het_group: int
    node_index: int
    gpus: tuple[str, ...]
    device_index: int | None
    port_names: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    transfer_ranks: tuple[int, ...]

    @classmethod
    def create(
        cls,
        *,
        role: str,
        index: int,
        het_group: int,
        node_index: int,
        gpus: tuple[str, ...] | list[str] = (),
        device_index: int | None = None,
        port_names: tuple[str, ...] | list[str] = (),
        env: Mapping[str, str] | None = None,
        transfer_ranks: tuple[int, ...] | list[int] = (),
    ) -> ChildSpec:
        """Validate and build. Raises PlanError naming the child, the field and the value."""
        name = f"child {role}[{index}]"
        if role not in ROLES:
            raise PlanError(f"{name}: role={role!r}: expected one of {ROLES}")
        for field_name, value in (("index", index), ("het_group", het_group), ("node_index", node_index)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PlanError(f"{name}: {field_name}={value!r}: expected an integer >= 0")
        gpus = tuple(str(g) for g in gpus)
        if any(not g.isdigit() for g in gpus) or len(set(gpus)) != len(gpus):
            raise PlanError(f"{name}: gpus={gpus}: expected distinct node GPU ordinals like ('0', '1')")
        if device_index is not None and not 0 <= device_index < len(gpus):
            raise PlanError(f"{name}: device_index={device_index} not in [0, {len(gpus)}) for gpus={gpus}")
        ports = tuple(port_names)
        bad = [p for p in ports if not isinstance(p, str) or not _PORT_NAME.match(p)]
        if bad or len(set(ports)) != len(ports):
            raise PlanError(f"{name}: port_names={ports}: expected distinct names like 'http', 'nccl'")
        items = tuple(sorted((env or {}).items()))
        for key, value in items:
            if not _ENV_KEY.match(key) or not isinstance(value, str) or "\0" in value:
                raise PlanError(
                    f"{name}: env {key}={value!r}: expected an identifier and a string without NUL"
                )
            if key in GUARD_SET_KEYS or key.startswith(child_env.PORT_PREFIX):
                raise PlanError(f"{name}: env {key} is set by the guard; the plan may not set it")
        return cls(
            role=role,
            index=index,
            het_group=het_group,
            node_index=node_index,
            gpus=gpus,
            device_index=device_index,
            port_names=ports,
            env=items,
            transfer_ranks=tuple(int(r) for r in transfer_ranks),
        )

    @property
    def env_dict(self) -> dict[str, str]:
        return dict(self.env)

    def compute_gpus(self, rollout_tp: int = 1) -> tuple[str, ...]:
        """The node GPU ordinals it computes on (a subset of `gpus`, which colocated children see whole): a
        rollout engine's `rollout_tp` GPUs from its `device_index`, any other child's one device; () on CPU.
        `device_index` None is the first visible GPU (what the child does without MOPD_BASE_GPU_ID,
        `runtime/child_device.py`). The one rule for a child's GPUs: the placement's GPU-sharing check, the
        transfer ranks, the memory plan and the rank map all read it. A rollout engine given fewer than
        `rollout_tp` GPUs from its device gets fewer (the transfer ranks refuse it)."""
        if not self.gpus:
            return ()
        base = self.device_index or 0
        return self.gpus[base : base + rollout_tp] if self.role == "rollout" else (self.gpus[base],)

    @property
    def label(self) -> str:
        """`actor[3]`, or `probe[5] (actor[3])` for a probe standing in for another role."""
        env = self.env_dict
        stands_for = (
            f" ({env[child_env.PLAN_ROLE]}[{env[child_env.PLAN_INDEX]}])"
            if child_env.PLAN_ROLE in env
            else ""
        )
        return f"{self.role}[{self.index}]{stands_for}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "index": self.index,
            "het_group": self.het_group,
            "node_index": self.node_index,
            "gpus": list(self.gpus),
            "device_index": self.device_index,
            "port_names": list(self.port_names),
            "env": dict(self.env),
            "transfer_ranks": list(self.transfer_ranks),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ChildSpec:
        """Inverse of `to_dict`. Raises PlanError on a missing or malformed key."""
        try:
            return cls.create(**{k: data[k] for k in _CHILD_KEYS})
        except KeyError as exc:
            raise PlanError(f"plan child record {dict(data)!r} lacks key {exc.args[0]!r}") from None
        except TypeError as exc:
            raise PlanError(f"plan child record {dict(data)!r} is malformed: {exc}") from None


_CHILD_KEYS = (
    "role",
    "index",
    "het_group",
    "node_index",
    "gpus",
    "device_index",
    "port_names",
    "env",
    "transfer_ranks",
)


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """One het group as planned: its name, node count and GPUs per node (hosts come at start)."""

    name: str
    het_group: int
    nodes: int
    gpus_per_node: int


@dataclass(frozen=True, slots=True)
class JobPlan:
    """Every child of one job. Build with `plan.placement.place_children(cfg)` or `JobPlan.from_dict(...)`.

    Attributes:
        name: the run's name.
        shape: "heterogeneous" or "colocated" (cluster.shape).
        mode: "separated" or "colocated" (rollout.mode).
        groups: the het groups in component order.
        children: every child, sorted by (het group, node, role, index).
        infer_world, train_world: AWEX world sizes (rollout ranks, trainer ranks).
        probe: True for a probe-only plan (`as_probe()`).
    """

    name: str
    shape: str
    mode: str
    groups: tuple[GroupPlan, ...]
    children: tuple[ChildSpec, ...]
    infer_world: int
    train_world: int
    probe: bool = False

    @property
    def het_size(self) -> int:
        return len(self.groups)

    @property
    def transfer_world(self) -> int:
        return self.infer_world + self.train_world

    def children_for(self, het_group: int, node_index: int) -> tuple[ChildSpec, ...]:
        """The children one guard spawns: those of its het group and node index."""
        return tuple(c for c in self.children if c.het_group == het_group and c.node_index == node_index)

    def by_role(self, role: str) -> tuple[ChildSpec, ...]:
        return tuple(c for c in self.children if c.role == role)

    def roles_in_group(self, het_group: int) -> tuple[str, ...]:
        """The roles of a het group's children, in first-seen order."""
        return tuple(dict.fromkeys(c.role for c in self.children if c.het_group == het_group))

    def as_probe(self) -> JobPlan:
        """The same plan with every child a `probe` (index = position in the plan; placement, GPUs, ports,
        transfer ranks kept; the original role and index in MOPD_PLAN_ROLE / MOPD_PLAN_INDEX)."""
        if self.probe:
            return self
        probes = []
        for position, child in enumerate(self.children):
            env = {**child.env_dict, child_env.PLAN_ROLE: child.role, child_env.PLAN_INDEX: str(child.index)}
            probes.append(replace(child, role=PROBE_ROLE, index=position, env=tuple(sorted(env.items()))))
        return replace(self, children=tuple(probes), probe=True)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": PLAN_VERSION,
            "name": self.name,
            "shape": self.shape,
            "mode": self.mode,
            "groups": [
                {"name": g.name, "het_group": g.het_group, "nodes": g.nodes, "gpus_per_node": g.gpus_per_node}
                for g in self.groups
            ],
            "infer_world": self.infer_world,
            "train_world": self.train_world,
            "probe": self.probe,
            "children": [c.to_dict() for c in self.children],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobPlan:
        """Inverse of `to_dict`. Raises PlanError naming the bad key (or an unknown version)."""
        if data.get("version") != PLAN_VERSION:
            raise PlanError(f"plan version={data.get('version')!r}: expected {PLAN_VERSION}")
        try:
            groups = tuple(GroupPlan(**g) for g in data["groups"])
            children = tuple(ChildSpec.from_dict(c) for c in data["children"])
            plan = cls(
                name=str(data["name"]),
                shape=str(data["shape"]),
                mode=str(data["mode"]),
                groups=groups,
                children=children,
                infer_world=int(data["infer_world"]),
                train_world=int(data["train_world"]),
                probe=bool(data["probe"]),
            )
        except KeyError as exc:
            raise PlanError(f"plan lacks key {exc.args[0]!r}") from None
        except TypeError as exc:
            raise PlanError(f"plan is malformed: {exc}") from None
        for child in plan.children:
            if child.het_group >= len(groups) or child.node_index >= groups[child.het_group].nodes:
                raise PlanError(
                    f"{child.label}: het group {child.het_group} node {child.node_index} is outside the "
                    f"plan's groups {[(g.name, g.nodes) for g in groups]}"
                )
        return plan

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the plan atomically (mopd_hpc.atomic) and return the path."""
        atomic_write_text(path, self.to_json())
        return Path(path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> JobPlan:
        """Read a plan.json. Raises PlanError naming the path when it is unreadable or malformed."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise PlanError(f"cannot read the job plan {path}: {exc}") from None
        if not isinstance(data, dict):
            raise PlanError(f"job plan {path}: expected a JSON object")
        try:
            return cls.from_dict(data)
        except PlanError as exc:
            raise PlanError(f"job plan {path}: {exc}") from None


def child_environment(child: ChildSpec, backend: str, het_size: int) -> dict[str, str]:
    """What a guard passes to `child` besides its identity: the plan's env, MOPD_BACKEND, MOPD_HET_GROUP,
    MOPD_HET_SIZE (the local backend's topology reads them), MOPD_TRANSFER_RANKS (comma-separated, empty
    when none) and, for a child that starts at a device other than its first, MOPD_BASE_GPU_ID."""
    env = child.env_dict
    env[child_env.BACKEND] = backend
    env[child_env.HET_GROUP] = str(child.het_group)
    env[child_env.HET_SIZE] = str(het_size)
    env[child_env.TRANSFER_RANKS] = ",".join(str(r) for r in child.transfer_ranks)
    if child.device_index is not None:
        env[child_env.BASE_GPU_ID] = str(child.device_index)
    return env
