"""The guard's settings (`GuardConfig`), validated at start; the guard itself is runtime/guard/server.py."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mopd_hpc.records.run_dir import guard_record_file
from mopd_hpc.runtime.gpus import GpuTokenError, NodeGpus, node_gpus
from mopd_hpc.runtime.guard.env_policy import check_site_key
from mopd_hpc.runtime.guard.fork_server import FORK_ROLES, PRELOAD_MODULES
from mopd_hpc.runtime.guard.roles import RoleRegistry
from mopd_hpc.runtime.http_limits import DEFAULT_LIMITS, HttpLimits
from mopd_hpc.runtime.ports import LeasePolicy, PortOwner

#: The owner of the guard's own HTTP port lease.
GUARD_ROLE = "guard"


class GuardConfigError(ValueError):
    """A guard setting is invalid."""


@dataclass(frozen=True, slots=True)
class GuardConfig:
    """Everything one guard needs; build with `GuardConfig.create` (env is passed in, read at the edge)."""

    run_dir: Path
    job_id: str
    host: str
    lease_policy: LeasePolicy
    base_env: Mapping[str, str]
    bind: str = "127.0.0.1"
    port: int = 0
    kill_wait_s: float = 10.0
    checkpoint_wait_s: float = 60.0
    roles: RoleRegistry = field(default_factory=RoleRegistry)
    #: The GPUs a spawn may name; None: `node_gpus(base_env)` at `create`.
    node_gpus: NodeGpus | None = None
    #: Env keys the site allows a spawn to set besides env_policy.py's (`mopd-guard --allow-env`).
    site_env_keys: frozenset[str] = frozenset()
    http_limits: HttpLimits = DEFAULT_LIMITS
    #: Roles whose children fork from the fork server (runtime/guard/fork_server.py); empty: all exec'ed
    #: (`mopd-guard --exec-children`).
    fork_roles: frozenset[str] = FORK_ROLES
    #: What the fork server imports before its first fork.
    preload: tuple[str, ...] = PRELOAD_MODULES

    @classmethod
    def create(cls, run_dir: str | Path, job_id: str, host: str, **kwargs: Any) -> GuardConfig:
        """Raises GuardConfigError naming the bad setting."""
        run_dir = Path(run_dir).resolve()
        if not run_dir.is_dir():
            raise GuardConfigError(f"run_dir={str(run_dir)!r} is not a directory: create it before the guard")
        if not host or "/" in host or host.startswith("."):
            raise GuardConfigError(f"host={host!r} is invalid: expected a host name usable in file names")
        try:
            if kwargs.get("node_gpus") is None:
                kwargs["node_gpus"] = node_gpus(kwargs.get("base_env", {}))
            kwargs["site_env_keys"] = frozenset(check_site_key(k) for k in kwargs.get("site_env_keys", ()))
        except (GpuTokenError, ValueError) as exc:
            raise GuardConfigError(str(exc)) from None
        cfg = cls(run_dir=run_dir, job_id=job_id, host=host, **kwargs)
        PortOwner.create(job_id, GUARD_ROLE, 0)  # validates job_id
        for name in ("kill_wait_s", "checkpoint_wait_s"):
            if not 0 <= getattr(cfg, name) <= 3600:
                raise GuardConfigError(f"{name}={getattr(cfg, name)} is invalid: expected 0..3600 seconds")
        if not 0 <= cfg.port <= 65535:
            raise GuardConfigError(f"port={cfg.port} is invalid: expected 0 (lease one) or 1..65535")
        return cfg

    @property
    def guard_file(self) -> Path:
        return guard_record_file(self.run_dir, self.host)
