"""Rank topology of one process: who am I in the job, on which host, with which GPU.

`RankTopology.from_env(env)` reads a task's environment (passed in; never `os.environ` here) and
returns a frozen, validated record (DESIGN.md §4). Rules, each for a reported failure:
- hosts come from `SLURM_STEP_NODELIST` / `SLURM_JOB_NODELIST_HET_GROUP_<n>`, never from
  `SLURM_JOB_NODELIST` inside a het job (launchers.md §2.2);
- `rank` / `world_size` count the tasks of this task's het group in this step. In a step spanning
  groups (`srun --het-group=0,1`) `SLURM_PROCID` and `SLURM_NODEID` are step-global and no Slurm
  variable names the group (slurm-local-findings.md §4), so the launcher exports `MOPD_HET_GROUP`
  and the rank is rebased by the tasks of earlier groups (`SLURM_NTASKS_HET_GROUP_<n>`);
- `local_device_index` is 0 when the task sees one GPU (with `--gpus-per-task` every task sees
  device 0), its local rank when it sees every GPU of its node, otherwise an error — never
  `SLURM_LOCALID` blindly;
- GPU tokens stay strings (`3`, `GPU-<uuid>`, `MIG-<uuid>`), see `gpus.py`;
- the local backend is chosen explicitly (`backend="local"` or `MOPD_BACKEND=local`) or when no
  Slurm job is visible; it never takes `SLURM_PROCID` as its rank;
- a guard's child on Slurm inherits the guard's step (one task per node), so the guard names the
  child's ranks with `MOPD_RANK`, `MOPD_WORLD_SIZE` (and `MOPD_LOCAL_RANK`, `MOPD_LOCAL_WORLD_SIZE`),
  which then replace the step's task ranks; hosts and het group still come from Slurm.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from mopd_hpc.runtime import child_env
from mopd_hpc.runtime.gpus import GpuTokenError, physical_gpus, token_kind
from mopd_hpc.runtime.topology_env import (
    ENV,
    HET_ENV,
    TopologyError,
    guard_child,
    read_int,
    read_local,
    read_slurm,
    read_slurm_gpus,
    read_var,
    read_visible_tokens,
)

__all__ = ["BACKENDS", "ENV", "HET_ENV", "NO_MIG_ROLES", "ROLES", "RankTopology", "TopologyError"]

Backend = Literal["slurm", "local"]
BACKENDS: tuple[str, ...] = ("slurm", "local")
#: Roles the guard may start (DESIGN.md §4); None means "not a child" (guard, CLI).
ROLES: tuple[str, ...] = ("actor", "teacher", "rollout", "probe")
#: Roles that cannot use a MIG instance (SGLang opens whole devices).
NO_MIG_ROLES: frozenset[str] = frozenset({"rollout"})


@dataclass(frozen=True, slots=True)
class RankTopology:
    """Where one process sits in the job. Build it with `from_env`; `to_dict()` is its JSON form.

    Fields (all counts are int, hosts and GPU tokens str):
        backend: "slurm" or "local".  role: the child's role, or None.
        job_id: the het leader's `SLURM_JOB_ID` ("local" by default on the local backend).
        het_group, het_size: this task's het component and the number of components (1: plain job).
        node_index, node_count, group_hosts: this host within the hosts of its het group in this step.
        hostname: this host, as Slurm names it (`SLURMD_NODENAME`).
        rank, world_size: within the het group, in this step.  local_rank: index among its host's tasks.
        local_world_size: tasks of the group on this host, None where Slurm does not say.
        gpu_tokens: `CUDA_VISIBLE_DEVICES` tokens in CUDA order, as given; `()` without GPUs.
        local_device_index: CUDA device ordinal this task uses (into gpu_tokens), None without GPUs.
        physical_gpus: best-known physical id of each token (see `gpus.physical_gpus`).
    """

    backend: str
    role: str | None
    job_id: str
    het_group: int
    het_size: int
    node_index: int
    node_count: int
    group_hosts: tuple[str, ...]
    hostname: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None
    gpu_tokens: tuple[str, ...]
    local_device_index: int | None
    physical_gpus: tuple[str, ...]

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise TopologyError(message)

        need(self.backend in BACKENDS, f"backend={self.backend!r}: expected one of {BACKENDS}")
        need(self.role is None or self.role in ROLES, f"role={self.role!r}: expected one of {ROLES} or None")
        need(bool(self.job_id), "job_id is empty: expected the het leader's SLURM_JOB_ID")
        need(
            0 <= self.het_group < self.het_size,
            f"het_group={self.het_group} not in [0, het_size={self.het_size})",
        )
        need(0 <= self.rank < self.world_size, f"rank={self.rank} not in [0, world_size={self.world_size})")
        need(
            len(self.group_hosts) == self.node_count and 0 <= self.node_index < self.node_count,
            f"node_index={self.node_index}, node_count={self.node_count} do not fit group_hosts={self.group_hosts}",
        )
        need(
            self.group_hosts[self.node_index] == self.hostname,
            f"hostname={self.hostname!r} is not "
            f"group_hosts[{self.node_index}]={self.group_hosts[self.node_index]!r}",
        )
        if self.local_world_size is not None:
            need(
                0 <= self.local_rank < self.local_world_size,
                f"local_rank={self.local_rank} not in [0, local_world_size={self.local_world_size})",
            )
        need(
            len(self.physical_gpus) == len(self.gpu_tokens),
            f"physical_gpus={self.physical_gpus} must have one entry per gpu token {self.gpu_tokens}",
        )
        if self.gpu_tokens:
            need(
                self.local_device_index is not None and 0 <= self.local_device_index < len(self.gpu_tokens),
                f"local_device_index={self.local_device_index} not in [0, {len(self.gpu_tokens)}) "
                f"for gpu_tokens={self.gpu_tokens}",
            )
        else:
            need(
                self.local_device_index is None, f"local_device_index={self.local_device_index} without GPUs"
            )
        for token in self.gpu_tokens:
            try:
                kind = token_kind(token)
            except GpuTokenError as exc:
                raise TopologyError(f"gpu_tokens={self.gpu_tokens}: {exc}") from None
            if kind == "mig" and self.role in NO_MIG_ROLES:
                raise TopologyError(
                    f"CUDA_VISIBLE_DEVICES token {token!r} is a MIG instance, which role {self.role!r} "
                    "cannot use (SGLang needs whole GPUs); give the rollout role whole GPUs"
                )

    @property
    def device_token(self) -> str | None:
        """The token of the device this task uses (`gpu_tokens[local_device_index]`), None without GPUs."""
        return None if self.local_device_index is None else self.gpu_tokens[self.local_device_index]

    @property
    def physical_gpu(self) -> str | None:
        """Best-known physical id of the device this task uses, None without GPUs."""
        return None if self.local_device_index is None else self.physical_gpus[self.local_device_index]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; keys as in `cases/topology/`, plus `physical_gpu` and `device_token`."""
        out = asdict(self)
        out["group_hosts"] = list(self.group_hosts)
        out["gpu_tokens"] = list(self.gpu_tokens)
        out["physical_gpus"] = list(self.physical_gpus)
        out["physical_gpu"] = self.physical_gpu
        out["device_token"] = self.device_token
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RankTopology:
        """Inverse of `to_dict` (derived keys ignored); raises TopologyError on missing or bad fields."""
        names = [f for f in cls.__dataclass_fields__]  # type: ignore[attr-defined]
        missing = [n for n in names if n not in data]
        if missing:
            raise TopologyError(
                f"topology record lacks {missing}; expected the keys of RankTopology.to_dict()"
            )
        values = {n: data[n] for n in names}
        for key in ("group_hosts", "gpu_tokens", "physical_gpus"):
            values[key] = tuple(values[key])
        return cls(**values)

    @classmethod
    def from_env(
        cls, env: Mapping[str, str], role: str | None = None, backend: str | None = None
    ) -> RankTopology:
        """Build the descriptor of the task whose environment is `env`.

        Args:
            env: the task's environment (e.g. `dict(os.environ)`, read by the caller at the edge).
            role: the child's role (one of ROLES) or None.
            backend: "slurm" or "local"; default `env["MOPD_BACKEND"]`, else "slurm" when
                `SLURM_JOB_ID` is set, else "local".
        Raises:
            TopologyError: unsupported or contradictory input, naming the variable and its value.
        """
        chosen = (
            backend or env.get(ENV["mopd_backend"]) or ("slurm" if read_var(env, ENV["job_id"]) else "local")
        )
        if chosen not in BACKENDS:
            source = "backend" if backend else ENV["mopd_backend"]
            raise TopologyError(f"{source}={chosen!r}: expected one of {BACKENDS}")
        fields = read_local(env) if chosen == "local" else read_slurm(env)
        tokens = read_visible_tokens(env)
        slurm_gpus = None if chosen == "local" else read_slurm_gpus(env)
        # SLURM_GPUS_ON_NODE describes the Slurm task; a guard child sees the GPUs its guard gave it.
        per_task = chosen == "slurm" and not guard_child(env)
        gpus_on_node = read_int(env, ENV["gpus_on_node"]) if per_task else None
        device = _local_device_index(tokens, fields["local_rank"], fields["local_world_size"], gpus_on_node)
        return cls(
            backend=chosen,
            role=role,
            gpu_tokens=tokens,
            local_device_index=device,
            physical_gpus=physical_gpus(tokens, slurm_gpus),
            **fields,
        )


def _local_device_index(
    tokens: Sequence[str], local_rank: int, tasks_on_node: int | None, gpus_on_node: int | None
) -> int | None:
    """0 with one visible GPU; the local rank when the task sees every GPU of its node; else an error."""
    visible = ",".join(tokens)
    if not tokens:
        return None
    if len(tokens) == 1:
        return 0
    if gpus_on_node is not None and gpus_on_node != len(tokens):
        raise TopologyError(
            f"CUDA_VISIBLE_DEVICES={visible!r} shows {len(tokens)} of the {gpus_on_node} GPUs of this node "
            f"(SLURM_GPUS_ON_NODE={gpus_on_node}): no rule picks this task's device; give each task one GPU "
            "(--gpus-per-task=1) or let it see every GPU of the node"
        )
    if tasks_on_node is not None and tasks_on_node > len(tokens):
        raise TopologyError(
            f"CUDA_VISIBLE_DEVICES={visible!r} shows {len(tokens)} GPUs but this node runs {tasks_on_node} "
            "tasks of the group: more tasks than GPUs; run at most one task per GPU"
        )
    if local_rank >= len(tokens):
        raise TopologyError(
            f"local rank {local_rank} (SLURM_LOCALID or {child_env.LOCAL_RANK}) has no GPU among the {len(tokens)} of "
            f"CUDA_VISIBLE_DEVICES={visible!r}; run at most one task per GPU"
        )
    return local_rank
