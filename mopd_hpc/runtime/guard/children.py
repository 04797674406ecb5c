"""The guard's children: spawn in their own session, watch their exit, kill their whole process group.

A child of (role, index) is `<guard's python> -m <module>` started through `pdeath_exec.py` (parent-death
signal, then exec in place: the reported pid is the worker's), in a new session and process group
(`start_new_session=True`), stdin from /dev/null, and its output in per-child files; a child of a fork
role is forked instead from the guard's fork server, which imported the roles' heavy modules once
(runtime/guard/fork_server.py: same session, files, fds and environment; the guard adopts it):

    run_dir/logs/<host>/<role>-<index>.g<generation>.out   (stdout)
    run_dir/logs/<host>/<role>-<index>.g<generation>.err   (stderr)

`generation` counts the spawns of one (role, index) on this guard, from 1. Exit is noticed through a pidfd
in the event loop (no polling thread). Kill (STYLE.md rule 10): SIGTERM to the group and to every process
of the child's tree (then SIGCONT, so a stopped one acts on it), wait up to `wait_s`, SIGKILL to them, wait
until none is left. Safe to call many times.

The tree (runtime/guard/proctree.py) is the group, the descendants by parent links, and the orphans the
guard adopted as subreaper that carry the child's identity in their environment: a process that started
its own session (`setsid`) is in it. What is guaranteed that no process of a child outlives it:
- kill of a child, guard teardown: every process of its tree as above (one that left its session *and*
  was exec'ed with a cleared environment *and* whose parent died is found at teardown only, through the
  keeper below, when the guard exits);
- the guard SIGKILLed: its children get SIGKILL (parent-death signal); every orphan below them is
  re-parented to the keeper (runtime/guard/keeper.py, the guard's parent, a subreaper), which kills every
  descendant it has (SIGTERM, the guard's kill wait, SIGKILL) and exits with the guard's signal;
- the keeper SIGKILLed: the guard gets SIGHUP (its parent-death signal) and kills every child's tree at
  once; both SIGKILLed at once: the children die (parent-death signal), an orphan of another session is
  left to pid 1 — the local backend then kills every process carrying the job's id (launch/local.py), and
  a Slurm step's cgroup is killed by Slurm when the step ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from mopd_hpc.records.run_dir import child_log_paths
from mopd_hpc.runtime import child_env
from mopd_hpc.runtime.guard import env_policy, proctree
from mopd_hpc.runtime.guard.events import EventLog
from mopd_hpc.runtime.guard.fork_server import ForkedProcess, GuardForks
from mopd_hpc.runtime.guard.spawn_env import build_child_env
from mopd_hpc.runtime.ports import PortLease
from mopd_hpc.runtime.signals import (
    PARENT_DEATH_SIGNAL,
    group_alive,
    group_members,
    killpg_quiet,
    signal_name,
)

#: The wrapper that sets the parent-death signal and execs the child.
PDEATH_EXEC = Path(__file__).with_name("pdeath_exec.py")
#: After SIGKILL, how long to wait for the group to disappear before reporting it stuck.
SIGKILL_REAP_S = 5.0
#: Period of the group-emptiness poll while killing.
_POLL_S = 0.02
#: Period of the reaping of adopted orphans (the guard is their subreaper).
_REAP_S = 1.0


@dataclass(slots=True, eq=False)
class Child:
    """One spawned generation of (role, index). Mutable inside the guard; `to_dict()` crosses the wire."""

    role: str
    index: int
    generation: int
    module: str
    #: The process: exec'ed (Popen), or forked by the fork server and adopted (ForkedProcess).
    popen: subprocess.Popen[bytes] | ForkedProcess
    stdout: Path
    stderr: Path
    ports: dict[str, int]
    gpus: list[str] | None
    started_ts: float
    exit_code: int | None = None
    signal: str | None = None
    ended_ts: float | None = None
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    #: Identity keys of its environment (inherited by its descendants): how an adopted orphan is matched.
    tag: dict[str, str] = field(default_factory=dict)
    #: Every process seen in its tree (pid → psutil handle, which knows a reused pid).
    seen: dict[int, psutil.Process] = field(default_factory=dict)

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
        site_env_keys: Collection[str] = (),
        fork_roles: Collection[str] = (),
        preload: Collection[str] = (),
    ) -> None:
        """`node_addr`: the address the guard listens on; each child gets it as MOPD_NODE_ADDR (and binds
        it). `site_env_keys`: env keys the site allowed besides env_policy.py's (`mopd-guard --allow-env`).
        `fork_roles`: roles whose children fork from a fork server that imported `preload`
        (runtime/guard/fork_server.py; empty: every child is exec'ed)."""
        self.site_env_keys = frozenset(site_env_keys)
        self.run_dir = Path(run_dir)
        self.host = host
        self.node_addr = node_addr
        self.job_id = job_id
        self.events = events
        self.base_env = dict(base_env)
        zygote_env = build_child_env(
            base_env, {}, {**self.job_tag(), child_env.NODE_ADDR: node_addr}, None, {}, site_env_keys
        )
        self.forks = GuardForks(fork_roles, preload, zygote_env, self.run_dir, events)
        self._generations: dict[tuple[str, int], list[Child]] = {}
        self._reaper: asyncio.Task[None] | None = None

    def next_generation(self, role: str, index: int) -> int:
        """The generation the next spawn of (role, index) gets (1 for the first)."""
        return len(self._generations.get((role, index), [])) + 1

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
        generation = self.next_generation(role, index)
        identity = {
            child_env.ROLE: role,
            child_env.INDEX: str(index),
            child_env.GENERATION: str(generation),
            **self.job_tag(),
            child_env.NODE_ADDR: self.node_addr,
        }
        env = build_child_env(self.base_env, env_overrides, identity, gpus, ports, self.site_env_keys)
        out_path, err_path = child_log_paths(self.run_dir, self.host, role, index, generation)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        fds = sorted(lease.fd for lease in ports.values())
        popen = self.forks.fork(role, module, env, out_path, err_path, fds)
        if popen is None:
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
                    pass_fds=fds,
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
            tag={
                k: identity[k]
                for k in (
                    child_env.JOB_ID,
                    child_env.HOST,
                    child_env.ROLE,
                    child_env.INDEX,
                    child_env.GENERATION,
                )
            },
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
            env=env_policy.recorded(env_overrides),  # every override, secret-looking values redacted
            forked=isinstance(popen, ForkedProcess),
        )
        self._watch(child)
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap_adopted_forever())
        return child

    async def _reap_adopted_forever(self) -> None:
        while True:
            await asyncio.sleep(_REAP_S)
            proctree.reap_adopted(self._popen_pids())

    def _popen_pids(self) -> set[int]:
        """The guard's own children: every spawned generation, and the fork server."""
        return {c.pid for c in self.all()} | ({self.forks.pid} if self.forks.pid is not None else set())

    def job_tag(self) -> dict[str, str]:
        """What every child of this guard, and every descendant of one, carries in its environment."""
        return {
            child_env.JOB_ID: self.job_id,
            child_env.HOST: self.host,
            child_env.RUN_DIR: str(self.run_dir),
        }

    def members(self, child: Child) -> list[psutil.Process]:
        """The live processes of `child`'s tree (itself included while it runs): see the module docstring."""
        found = []
        if not child.exited.is_set():  # once reaped, its pid may be another process's
            found += proctree.tree(child.pid)
        for pid in group_members(child.pgid):
            with contextlib.suppress(psutil.Error):
                found.append(psutil.Process(pid))
        found += proctree.tagged_trees(child.tag, self._popen_pids())
        for proc in found:
            known = child.seen.get(proc.pid)
            if known is None or not known.is_running():
                child.seen[proc.pid] = proc
        return proctree.live(child.seen.values())

    def kill_all_now(self) -> None:
        """SIGKILL every child's whole tree and every process carrying this guard's job tag, no waiting
        (the keeper is gone: runtime/guard/keeper.py)."""
        for child in self.all():
            sent = killpg_quiet(child.pgid, signal.SIGKILL)
            if proctree.kill_now(self.members(child)) or sent:
                self._emit(
                    "kill",
                    child,
                    signal="SIGKILL",
                )
        proctree.kill_now(proctree.tagged_trees(self.job_tag(), self._popen_pids(), anywhere=True))

    async def sweep(self, wait_s: float) -> int:
        """After every child is killed: SIGTERM, then after `wait_s` SIGKILL, every process left that carries
        this guard's job tag, wherever it was re-parented. Returns how many there were."""
        left = proctree.tagged_trees(self.job_tag(), self._popen_pids(), anywhere=True)
        if not left:
            return 0
        self.events.emit("sweep", pids=sorted(p.pid for p in left))
        for signum, wait in ((signal.SIGTERM, wait_s), (signal.SIGKILL, SIGKILL_REAP_S)):
            proctree.signal_all(left, signum)
            deadline = time.monotonic() + wait
            while proctree.live(left) and time.monotonic() < deadline:
                proctree.reap_adopted(self._popen_pids())
                await asyncio.sleep(_POLL_S)
        return len(left)

    def _emit(self, event: str, child: Child, **fields: object) -> None:
        """An event about one child generation: its role, index, generation and pid, then `fields`."""
        self.events.emit(
            event, role=child.role, index=child.index, generation=child.generation, pid=child.pid, **fields
        )

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
        self._emit(
            "exit",
            child,
            exit_code=child.exit_code,
            signal=child.signal,
        )

    async def signal_group(self, child: Child, signum: int, whole_tree: bool = False) -> bool:
        """Send `signum` to the child's group (and with `whole_tree`, to every process of its tree, those
        in other sessions included); False when none was left to signal."""
        sent = killpg_quiet(child.pgid, signum)
        if whole_tree:
            sent = proctree.signal_all(self.members(child), signum) > 0 or sent
        if sent:
            self._emit(
                "kill",
                child,
                signal=signal_name(signum),
            )
        return sent

    def gone(self, child: Child) -> bool:
        """True when the child is reaped and no process of its group or tree is left."""
        return child.exited.is_set() and not group_alive(child.pgid) and not self.members(child)

    async def wait_gone(self, child: Child, timeout_s: float) -> bool:
        """Wait until the child is reaped and no process of its group or tree is left; True if so in time."""
        deadline = time.monotonic() + timeout_s
        while True:
            proctree.reap_adopted(self._popen_pids())
            if self.gone(child):
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(_POLL_S)

    async def kill(self, child: Child, wait_s: float) -> bool:
        """SIGTERM the group and tree, wait `wait_s`, SIGKILL them, wait until none is left. Idempotent.

        Returns:
            True when no process of the group or tree is left.
        """
        if self.gone(child):
            return True
        await self.signal_group(child, signal.SIGTERM, whole_tree=True)
        # a stopped process (SIGSTOP, a debugger) acts on SIGTERM only once continued (as systemd does)
        killpg_quiet(child.pgid, signal.SIGCONT)
        proctree.signal_all(self.members(child), signal.SIGCONT)
        if await self.wait_gone(child, wait_s):
            return True
        await self.signal_group(child, signal.SIGKILL, whole_tree=True)
        return await self.wait_gone(child, SIGKILL_REAP_S)

    def tail(self, path: Path, lines: int = 40) -> str:
        """The last `lines` lines of a child log (for error reports, STYLE.md rule 9)."""
        with contextlib.suppress(OSError):
            return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
        return ""
