"""The guard's children: spawn in their own session, watch their exit, kill their whole process group.

A child of (role, index) is `<guard's python> -m <module>` started through `pdeath_exec.py` (parent-death
signal, then exec in place: the reported pid is the worker's), in a new session and process group
(`start_new_session=True`), stdin from /dev/null, and its output in per-child files:

    run_dir/logs/<host>/<role>-<index>.g<generation>.out   (stdout)
    run_dir/logs/<host>/<role>-<index>.g<generation>.err   (stderr)

`generation` counts the spawns of one (role, index) on this guard, from 1. Exit is noticed through a pidfd
in the event loop (no polling thread). Kill (STYLE.md rule 10): SIGTERM to the group, wait up to
`wait_s`, SIGKILL to the group, wait until no process of the group is left. Safe to call many times.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mopd_hpc.records.run_dir import child_log_paths
from mopd_hpc.runtime import child_env
from mopd_hpc.runtime.guard.events import EventLog
from mopd_hpc.runtime.ports import PORT_ENV_PREFIX, PortLease
from mopd_hpc.runtime.signals import PARENT_DEATH_SIGNAL, group_alive, killpg_quiet, signal_name

#: The wrapper that sets the parent-death signal and execs the child.
PDEATH_EXEC = Path(__file__).with_name("pdeath_exec.py")
#: After SIGKILL, how long to wait for the group to disappear before reporting it stuck.
SIGKILL_REAP_S = 5.0
#: Period of the group-emptiness poll while killing.
_POLL_S = 0.02
#: Environment keys the guard sets for every child; overrides may not set them (`runtime/child_env.py`).
IDENTITY_KEYS = child_env.IDENTITY_KEYS
_ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ChildEnvError(ValueError):
    """An env override is malformed or collides with a key the guard sets (HTTP 400)."""


def build_child_env(
    base: Mapping[str, str],
    overrides: Mapping[str, str],
    identity: Mapping[str, str],
    gpus: list[str] | None,
    ports: Mapping[str, PortLease],
) -> dict[str, str]:
    """The child's environment: `base` (the guard's), minus inherited `MOPD_PORT_*`, plus `overrides`,
    identity keys, `CUDA_VISIBLE_DEVICES` (GPU tokens as given, comma-joined; only when `gpus` is not
    None) and `MOPD_PORT_<NAME>` per named port. Values pass through unchanged (commas, quotes, `=`,
    newlines): no `k=v,k=v` serialization anywhere.

    Raises:
        ChildEnvError: a key is not an identifier, a value holds NUL, or an override sets a guard-set key.
    """
    reserved = set(identity) | {lease.env_key for lease in ports.values()}
    if gpus is not None:
        reserved.add("CUDA_VISIBLE_DEVICES")
    for key, value in overrides.items():
        if not _ENV_KEY_RE.match(key):
            raise ChildEnvError(f"env key {key!r} is invalid: expected [A-Za-z_][A-Za-z0-9_]*")
        if "\0" in value:
            raise ChildEnvError(f"env value of {key} contains a NUL byte, which no environment can carry")
        if key in reserved or key.startswith(PORT_ENV_PREFIX):
            raise ChildEnvError(
                f"env key {key} is set by the guard (identity, GPU tokens or named ports); "
                "pass GPUs in 'gpus' and ports in 'ports' instead"
            )
    env = {k: v for k, v in base.items() if not k.startswith(PORT_ENV_PREFIX)}
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(overrides)
    env.update(identity)
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    for lease in ports.values():
        env[lease.env_key] = str(lease.port)
    return env


@dataclass(slots=True, eq=False)
class Child:
    """One spawned generation of (role, index). Mutable inside the guard; `to_dict()` crosses the wire."""

    role: str
    index: int
    generation: int
    module: str
    popen: subprocess.Popen[bytes]
    stdout: Path
    stderr: Path
    ports: dict[str, int]
    gpus: list[str] | None
    started_ts: float
    exit_code: int | None = None
    signal: str | None = None
    ended_ts: float | None = None
    exited: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def pgid(self) -> int:
        return self.popen.pid  # session leader: its pid is its group id

    @property
    def state(self) -> str:
        return "exited" if self.exited.is_set() else "running"

    def to_dict(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "index": self.index,
            "generation": self.generation,
            "module": self.module,
            "pid": self.pid,
            "pgid": self.pgid,
            "state": self.state,
            "exit_code": self.exit_code,
            "signal": self.signal,
            "started_ts": self.started_ts,
            "ended_ts": self.ended_ts,
            "ports": dict(self.ports),
            "gpus": self.gpus,
            "stdout": str(self.stdout),
            "stderr": str(self.stderr),
        }


class ChildSupervisor:
    """Spawns, watches and kills the guard's children; call its methods from the event-loop thread only
    (the parent-death signal is tied to the forking thread, which must live as long as the guard)."""

    def __init__(
        self,
        run_dir: Path,
        host: str,
        job_id: str,
        events: EventLog,
        base_env: Mapping[str, str],
        node_addr: str = "127.0.0.1",
    ) -> None:
        """`node_addr`: the address the guard listens on; each child gets it as MOPD_NODE_ADDR (and binds
        it)."""
        self.run_dir = Path(run_dir)
        self.host = host
        self.node_addr = node_addr
        self.job_id = job_id
        self.events = events
        self.base_env = dict(base_env)
        self._generations: dict[tuple[str, int], list[Child]] = {}

    def latest(self, role: str, index: int) -> Child | None:
        gens = self._generations.get((role, index))
        return gens[-1] if gens else None

    def all(self) -> list[Child]:
        return [c for gens in self._generations.values() for c in gens]

    def running(self) -> list[Child]:
        return [c for c in self.all() if not c.exited.is_set()]

    def spawn(
        self,
        role: str,
        index: int,
        module: str,
        env_overrides: Mapping[str, str],
        gpus: list[str] | None,
        ports: Mapping[str, PortLease],
    ) -> Child:
        """Start generation n+1 of (role, index). The caller checks that no generation is running.

        Raises:
            ChildEnvError: bad env overrides (nothing is started). OSError: fork/exec failed.
        """
        generation = len(self._generations.get((role, index), [])) + 1
        identity = {
            child_env.ROLE: role,
            child_env.INDEX: str(index),
            child_env.GENERATION: str(generation),
            child_env.JOB_ID: self.job_id,
            child_env.RUN_DIR: str(self.run_dir),
            child_env.HOST: self.host,
            child_env.NODE_ADDR: self.node_addr,
        }
        env = build_child_env(self.base_env, env_overrides, identity, gpus, ports)
        out_path, err_path = child_log_paths(self.run_dir, self.host, role, index, generation)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-S", str(PDEATH_EXEC), str(os.getpid()), str(int(PARENT_DEATH_SIGNAL))]
        argv += [sys.executable, "-m", module]
        with open(out_path, "ab") as out, open(err_path, "ab") as err:
            popen = subprocess.Popen(
                argv,
                env=env,
                cwd=self.run_dir,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
                pass_fds=sorted(lease.fd for lease in ports.values()),
            )
        child = Child(
            role=role,
            index=index,
            generation=generation,
            module=module,
            popen=popen,
            stdout=out_path,
            stderr=err_path,
            ports={name: lease.port for name, lease in ports.items()},
            gpus=gpus,
            started_ts=time.time(),
        )
        self._generations.setdefault((role, index), []).append(child)
        self.events.emit(
            "spawn",
            role=role,
            index=index,
            generation=generation,
            pid=child.pid,
            module=module,
            stdout=str(out_path),
            stderr=str(err_path),
            ports=child.ports,
            gpus=gpus,
        )
        self._watch(child)
        return child

    def _watch(self, child: Child) -> None:
        loop = asyncio.get_running_loop()
        try:
            pidfd = os.pidfd_open(child.pid)
        except (AttributeError, OSError):
            loop.create_task(self._poll_exit(child))
            return

        def on_ready() -> None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
            self._reap(child)

        loop.add_reader(pidfd, on_ready)

    async def _poll_exit(self, child: Child) -> None:
        while child.popen.poll() is None:
            await asyncio.sleep(_POLL_S * 5)
        self._reap(child)

    def _reap(self, child: Child) -> None:
        rc = child.popen.wait()
        child.ended_ts = time.time()
        if rc < 0:
            child.signal = signal_name(-rc)
        else:
            child.exit_code = rc
        child.exited.set()
        self.events.emit(
            "exit",
            role=child.role,
            index=child.index,
            generation=child.generation,
            pid=child.pid,
            exit_code=child.exit_code,
            signal=child.signal,
        )

    async def signal_group(self, child: Child, signum: int) -> bool:
        """Send `signum` to the child's group; False when the group is already gone."""
        sent = killpg_quiet(child.pgid, signum)
        if sent:
            self.events.emit(
                "kill",
                role=child.role,
                index=child.index,
                generation=child.generation,
                pid=child.pid,
                signal=signal_name(signum),
            )
        return sent

    async def wait_gone(self, child: Child, timeout_s: float) -> bool:
        """Wait until the child is reaped and no process of its group is left; True if so in time."""
        deadline = time.monotonic() + timeout_s
        while True:
            if child.exited.is_set() and not group_alive(child.pgid):
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(_POLL_S)

    async def kill(self, child: Child, wait_s: float) -> bool:
        """SIGTERM the group, wait `wait_s`, SIGKILL the group, wait until it is gone. Idempotent.

        Returns:
            True when no process of the group is left.
        """
        if child.exited.is_set() and not group_alive(child.pgid):
            return True
        await self.signal_group(child, signal.SIGTERM)
        if await self.wait_gone(child, wait_s):
            return True
        await self.signal_group(child, signal.SIGKILL)
        return await self.wait_gone(child, SIGKILL_REAP_S)

    def tail(self, path: Path, lines: int = 40) -> str:
        """The last `lines` lines of a child log (for error reports, STYLE.md rule 9)."""
        with contextlib.suppress(OSError):
            return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
        return ""
