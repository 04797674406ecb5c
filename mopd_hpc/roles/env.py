"""The environment of a guard child, read once at the edge, and the run it belongs to.

A guard child (actor, teacher, rollout) learns who it is from the environment the guard gives it
(the table `runtime/child_env.py`: identity keys, `runtime/plan.py::child_environment`, named ports):

    MOPD_RUN_DIR, MOPD_ROLE, MOPD_INDEX, MOPD_JOB_ID, MOPD_HOST, MOPD_NODE_ADDR, MOPD_BACKEND,
    MOPD_RANK, MOPD_WORLD_SIZE, MOPD_PORT_<NAME>, and the device: CUDA_VISIBLE_DEVICES, MOPD_BASE_GPU_ID

`RoleEnv.from_env(environ)` validates them into a frozen record (integers through the topology's reader,
`runtime/topology_env.read_int`; the device through `ChildDevice.from_env`); `load_run(run_dir, environ)` reads the
resolved run config `run_dir/config.yaml` (written by `mopd-submit`) and makes its model paths absolute.

Relative model paths in a config are relative to the directory `mopd-submit` ran in, while a child's
working directory is the run directory: `resolve_path` tries, in order, MOPD_SUBMIT_DIR, SLURM_SUBMIT_DIR,
PWD (the submitter's shell), then the run directory's parent, and keeps the first base under which the
path exists (`prepare_local_run` writes absolute paths into config.yaml, so local runs never need this).

Addresses (`runtime/node_address.py`): a child's servers and its rendezvous bind `bind_host`, the guard's own
address (MOPD_NODE_ADDR; without it loopback locally, this node's name resolved on a cluster), never every
interface unless the guard was told to bind them; endpoint records advertise `advertise_host`. The job's token
(`read_job_token`) is the run directory's token file, read once by each role.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from mopd_hpc.config import RunConfig
from mopd_hpc.records.job_token import GuardAuthError, read_token_file
from mopd_hpc.records.run_dir import CONFIG_FILE, TOKEN_FILE
from mopd_hpc.runtime import child_env
from mopd_hpc.runtime.child_device import ChildDevice
from mopd_hpc.runtime.node_address import LOOPBACK, NodeAddressError, is_wildcard, node_address
from mopd_hpc.runtime.topology_env import TopologyError, read_int

#: Logical key → environment variable (read only here).
ENV = {
    "run_dir": child_env.RUN_DIR,
    "role": child_env.ROLE,
    "index": child_env.INDEX,
    "job_id": child_env.JOB_ID,
    "host": child_env.HOST,
    "node_addr": child_env.NODE_ADDR,
    "backend": child_env.BACKEND,
    "rank": child_env.RANK,
    "world_size": child_env.WORLD_SIZE,
    "local_world_size": child_env.LOCAL_WORLD_SIZE,
}
#: Environment variables naming the directory relative model paths are relative to, in order.
SUBMIT_DIR_KEYS = (child_env.SUBMIT_DIR, "SLURM_SUBMIT_DIR", "PWD")


class RoleEnvError(ValueError):
    """A guard child's environment lacks a variable or holds a malformed one (named, with its value)."""


@dataclass(frozen=True, slots=True)
class RoleEnv:
    """Who this child is. Build with `RoleEnv.from_env(environ)`.

    Attributes:
        run_dir: the run directory (absolute).
        role, index: the child's role and index within the role.
        job_id: the job (Slurm job id, or `local-<pid>`).
        host: this node's name as the guard knows it.
        node_addr: the address this node's guard binds (MOPD_NODE_ADDR), None when not given.
        backend: "local" or "slurm".
        rank, world_size: rank within the role's group (MOPD_RANK / MOPD_WORLD_SIZE; 0 / 1 if absent).
        local_world_size: ranks of the role's group on this node (MOPD_LOCAL_WORLD_SIZE; 1 if absent): the
            actor ranks that compute at the same time on this node's CPUs.
        ports: named ports leased for this child (`master`, `http`, ...), name → TCP port.
        device: the device it computes on (`ChildDevice`: CUDA index, token, physical id; CPU without GPUs).
    """

    run_dir: Path
    role: str
    index: int
    job_id: str
    host: str
    backend: str
    rank: int = 0
    world_size: int = 1
    ports: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    device: ChildDevice = field(default_factory=ChildDevice)
    node_addr: str | None = None
    local_world_size: int = 1

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> RoleEnv:
        """Validate the guard-given variables. Raises RoleEnvError naming the variable and value."""

        def need(key: str) -> str:
            value = environ.get(ENV[key])
            if not value:
                raise RoleEnvError(
                    f"{ENV[key]} is not set: this entry point runs as a child of mopd-guard "
                    "(mopd-submit starts it); set it by hand only for debugging"
                )
            return value

        def integer(key: str, default: int | None) -> int:
            try:
                value = read_int(environ, ENV[key], default=default)
            except TopologyError as exc:
                raise RoleEnvError(str(exc)) from None
            if value is None:
                raise RoleEnvError(f"{ENV[key]}={environ.get(ENV[key])!r}: expected an integer >= 0")
            return value

        ports = {}
        for key, raw in environ.items():
            name = child_env.port_name(key)
            if name is not None:
                try:
                    ports[name] = int(raw)
                except ValueError:
                    raise RoleEnvError(f"{key}={raw!r}: expected a TCP port number") from None
        try:
            device = ChildDevice.from_env(environ)
        except TopologyError as exc:
            raise RoleEnvError(str(exc)) from None
        world = integer("world_size", 1)
        if world < 1:
            raise RoleEnvError(f"{ENV['world_size']}={world}: expected >= 1")
        return cls(
            run_dir=Path(need("run_dir")).absolute(),
            role=need("role"),
            index=integer("index", None),
            job_id=need("job_id"),
            host=environ.get(ENV["host"]) or "localhost",
            backend=environ.get(ENV["backend"]) or "local",
            rank=integer("rank", 0),
            world_size=world,
            ports=MappingProxyType(ports),
            device=device,
            node_addr=environ.get(ENV["node_addr"]) or None,
            local_world_size=max(1, integer("local_world_size", 1)),
        )

    def port(self, name: str) -> int:
        """The named port. Raises RoleEnvError naming the ports this child has."""
        if name not in self.ports:
            raise RoleEnvError(
                f"{self.role}[{self.index}] has no {port_env_name(name)} (named ports: "
                f"{sorted(self.ports) or 'none'}); the job plan must lease port {name!r} for it"
            )
        return self.ports[name]

    @property
    def bind_host(self) -> str:
        """Where a server of this child listens: the guard's address (MOPD_NODE_ADDR); without it loopback
        locally and this node's address on a cluster.

        Raises:
            RoleEnvError: on a cluster without MOPD_NODE_ADDR, MOPD_HOST does not resolve.
        """
        if self.node_addr:
            return self.node_addr
        if self.backend == "local":
            return LOOPBACK
        try:
            return node_address(self.host)
        except NodeAddressError as exc:
            raise RoleEnvError(f"{ENV['host']}={self.host!r}: {exc}") from None

    @property
    def advertise_host(self) -> str:
        """The address others reach this child's servers at (endpoint files carry it): `bind_host`, or the
        node's name when the guard binds every interface."""
        bind = self.bind_host
        return self.host if is_wildcard(bind) else bind

    @property
    def token_file(self) -> Path:
        """The job's token file: `run_dir/guard.token` (mode 0600)."""
        return self.run_dir / TOKEN_FILE


def master_address(role: RoleEnv) -> str:
    """The address of this child's torch rendezvous (the store binds it and the other ranks connect to it):
    `role.bind_host`, or this node's resolved address when the guard binds every interface.

    Raises:
        RoleEnvError: the address is needed from MOPD_HOST, which does not resolve.
    """
    bind = role.bind_host
    if not is_wildcard(bind):
        return bind
    try:
        return node_address(role.host)
    except NodeAddressError as exc:
        raise RoleEnvError(f"{ENV['host']}={role.host!r}: {exc}") from None


def read_job_token(role: RoleEnv) -> str:
    """The job's token, from `role.token_file` (read by each role once, at its start).

    Raises:
        RoleEnvError: the file is missing, empty, or readable by others (the message names the path and mode,
            never the token).
    """
    try:
        return read_token_file(role.token_file)
    except GuardAuthError as exc:
        raise RoleEnvError(f"the job's token: {exc}") from None


def cpu_threads(environ: Mapping[str, str], share: int = 1) -> int:
    """Torch CPU threads for a role child: its CPU budget split between the `share` children of the node
    that compute at the same time (the phases time-slice the rest: rollout, teachers and actor never
    compute together). At least 1.

    The budget is the CPUs this process may run on (its affinity mask), capped by `SLURM_CPUS_PER_TASK`
    when srun set it (a task's --cpus-per-task; Slurm confines a task to them only under task/affinity or
    cgroup CPU constraints, so the cap also holds where it does not). More threads than cores costs far more
    than it gains: OpenMP threads spin-wait for each other (measured here: 10x slower steps). `OMP_NUM_THREADS`,
    when set, caps the result (OpenMP's own per-process thread count, which torch.set_num_threads would
    otherwise override): jobs that share cores with others (the test suite's parallel workers) set it to 1.

    Raises:
        RoleEnvError: SLURM_CPUS_PER_TASK or OMP_NUM_THREADS is set but not a positive integer.
    """
    budget = len(os.sched_getaffinity(0))
    per_task = _positive(environ, "SLURM_CPUS_PER_TASK")
    if per_task is not None:
        budget = min(budget, per_task)
    threads = max(1, budget // max(1, share))
    omp = _positive(environ, "OMP_NUM_THREADS")
    return threads if omp is None else min(threads, omp)


def _positive(environ: Mapping[str, str], name: str) -> int | None:
    """environ[name] as a positive integer; None when unset or empty. Raises RoleEnvError on another value."""
    raw = environ.get(name)
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise RoleEnvError(f"{name}={raw!r}: expected a positive integer")
    return value


def port_env_name(name: str) -> str:
    return child_env.port_env_name(name)


def resolve_path(path: str, environ: Mapping[str, str], run_dir: Path | None = None) -> str:
    """`path` made absolute: kept when absolute; else joined to the first base (module docstring) under
    which it exists; else joined to the first base given (the error then names that path)."""
    if os.path.isabs(path):
        return path
    bases = [environ[k] for k in SUBMIT_DIR_KEYS if environ.get(k)]
    if run_dir is not None:
        bases.append(str(run_dir.parent))
    for base in bases:
        candidate = Path(base) / path
        if candidate.exists():
            return str(candidate.resolve())
    return str((Path(bases[0]) if bases else Path.cwd()) / path)


def with_absolute_paths(
    cfg: RunConfig, environ: Mapping[str, str], run_dir: Path | None = None, *, check_tasks: bool = True
) -> RunConfig:
    """`cfg` with every model and tokenizer path and jsonl source path (and held-out file) made absolute
    (`resolve_path`); `check_tasks`: as `RunConfig.from_dict`."""
    data = cfg.model_dump(mode="json")
    models = data["models"]
    models["actor"]["path"] = resolve_path(models["actor"]["path"], environ, run_dir)
    for teacher in models["teachers"]:
        teacher["path"] = resolve_path(teacher["path"], environ, run_dir)
    models["tokenizer"]["path"] = resolve_path(models["tokenizer"]["path"], environ, run_dir)
    for source in data["data"]["sources"]:
        if source.get("kind") == "jsonl":
            source["path"] = resolve_path(source["path"], environ, run_dir)
            if source.get("eval_path"):
                source["eval_path"] = resolve_path(source["eval_path"], environ, run_dir)
    return RunConfig.from_dict(data, source=str(run_dir or "<config>"), check_tasks=check_tasks)


def start_server_role(environ: Mapping[str, str]) -> tuple[RoleEnv, RunConfig]:
    """The common start of a server child (teacher, rollout): logging to stderr, SIGUSR2 ignored (a server
    holds no training state to checkpoint; the actor does), then the role's environment and its run's config.
    A server generates no data: its config's reasoning-gym tasks are not checked again (`mopd-submit` checked
    them, the actor checks them again), so it does not import reasoning-gym (≈ 1.3 CPU-s a process).

    Raises:
        RoleEnvError: a missing or malformed MOPD_* variable; ConfigError: the run's config.yaml.
    """
    import logging
    import signal
    import sys

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    role = RoleEnv.from_env(environ)
    return role, load_run(role.run_dir, environ, check_tasks=False)


def load_run(run_dir: Path, environ: Mapping[str, str], *, check_tasks: bool = True) -> RunConfig:
    """The run's resolved config (`run_dir/config.yaml`) with absolute paths; `check_tasks`: as
    `RunConfig.from_dict`.

    Raises:
        ConfigError: the file is missing, unreadable or invalid (named).
    """
    cfg = RunConfig.from_yaml(run_dir / CONFIG_FILE, check_tasks=check_tasks)
    return with_absolute_paths(cfg, environ, run_dir, check_tasks=check_tasks)
