"""The guard's handle on its fork server (runtime/guard/zygote.py): start it, wait for its imports, hand it
spawns, stop it.

A spawn forks from the zygote (`ForkServer.accepts`) when its role is one of the guard's `fork_roles`
(GuardConfig; by default the project's roles whose entry points import torch: `FORK_ROLES`), the zygote
is ready, and the child's environment equals the zygote's on every key a preloaded module may read at import:
all but the per-child ones (`MOPD_*`, which no preloaded module reads at import, and CUDA_VISIBLE_DEVICES,
read when CUDA starts). Any other difference (an override of OMP_NUM_THREADS, HF_HUB_OFFLINE, ...) execs
the child, as does a zygote that failed to start or died (it is not restarted), a guard that is not a
child subreaper (the forked child could not become its child), a node with GPU devices (`GPU_DEVICE_FILES`:
the CUDA driver is not fork-safe, and an import may initialize it, `torch.cuda.is_available()` does, which
would leave every forked child unable to use CUDA), and `mopd-guard --exec-children`.

The zygote starts at the first spawn of a fork role (`ForkServer.start`) and stops at the guard's teardown,
after the children and before the sweep of what carries the job's tag (the zygote carries it). The guard's
own spawns (autostart) wait for its imports, which each child would otherwise have paid itself; a spawn
request over HTTP waits at most `REQUEST_READY_WAIT_S`, so that it is answered well within a client's
timeout (GuardClient's default is 30 s) on a node whose imports are slow (a cold parallel file system), and
is exec'ed when the zygote is not ready by then. The zygote goes on importing for the spawns after it.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mopd_hpc.runtime import child_env
from mopd_hpc.runtime.guard import zygote
from mopd_hpc.runtime.guard.events import EventLog
from mopd_hpc.runtime.signals import PARENT_DEATH_SIGNAL

#: What the zygote imports: what the actor, teacher and rollout entry points all import (measured with
#: `python -X importtime` in a job's children), third-party modules and project modules that read no
#: environment at import.
PRELOAD_MODULES: tuple[str, ...] = (
    "numpy",
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.qwen3.modeling_qwen3",
    "safetensors.torch",
    "aiohttp.web",
    "pydantic",
    "yaml",
    "psutil",
    "mopd_hpc.config",
    "mopd_hpc.engines.frames.over_http",
)
#: Roles whose children fork from the zygote by default (each imports torch and transformers).
FORK_ROLES: frozenset[str] = frozenset({"actor", "teacher", "rollout"})
#: Longest wait for the zygote's imports before its spawns exec instead.
READY_TIMEOUT_S = 300.0
#: Longest wait of one spawn request (HTTP) for the zygote's imports before that child is exec'ed.
REQUEST_READY_WAIT_S = 5.0
#: Longest wait for the zygote's answer to one spawn.
SPAWN_TIMEOUT_S = 30.0
#: Environment keys that may differ between a forked child and the zygote (besides `MOPD_*`).
PER_CHILD_KEYS = frozenset({"CUDA_VISIBLE_DEVICES"})
#: Device files of a node with GPUs (NVIDIA's control device, AMD's compute device): no fork server there.
GPU_DEVICE_FILES: tuple[str, ...] = ("/dev/nvidiactl", "/dev/kfd")
_ZYGOTE = Path(zygote.__file__).with_name("pdeath_exec.py")
_PR_GET_CHILD_SUBREAPER = 37


class ForkServerError(OSError):
    """The zygote refused or failed a spawn (nothing was started)."""


def import_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of `env` a preloaded module may have read at import: all but `MOPD_*` and PER_CHILD_KEYS."""
    return {k: v for k, v in env.items() if not k.startswith(child_env.PREFIX) and k not in PER_CHILD_KEYS}


def fork_refusal() -> str | None:
    """Why this guard cannot fork its children (module docstring), or None when it can."""
    if not is_child_subreaper():
        return "the guard is not a child subreaper: a forked child could not become its own"
    devices = [path for path in GPU_DEVICE_FILES if os.path.exists(path)]
    if devices:
        return f"the node has GPU devices ({', '.join(devices)}): the CUDA driver is not fork-safe"
    return None


def is_child_subreaper() -> bool:
    """True when this process is a child subreaper (PR_GET_CHILD_SUBREAPER, man 2 prctl)."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        flag = ctypes.c_int(0)
        return libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) == 0 and flag.value == 1
    except (OSError, AttributeError):
        return False


@dataclass(slots=True)
class ForkedProcess:
    """A child forked by the zygote and adopted by the guard: the part of `subprocess.Popen` the supervisor
    uses (`pid`, `poll`, `wait`; `returncode` is -N after signal N, as Popen's)."""

    pid: int
    returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


class ForkServer:
    """One guard's zygote. Methods run on the guard's event-loop thread (the zygote's parent-death signal is
    tied to it)."""

    def __init__(self, env: Mapping[str, str], cwd: Path, preload: Sequence[str]) -> None:
        """`env`: the zygote's environment (the children's less their per-child keys); `cwd`: where it runs."""
        self.env = dict(env)
        self.cwd = Path(cwd)
        self.preload = tuple(preload)
        self.popen: subprocess.Popen[bytes] | None = None
        self.info: dict[str, Any] = {}
        self._sock: socket.socket | None = None
        self._ready: asyncio.Future[bool] | None = None

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    def start(self) -> None:
        """Start the zygote (once; from a coroutine: the wait for its imports, `importing`, begins with it).
        Raises OSError when it cannot be started."""
        if self.popen is not None:
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        guard, signum = str(os.getpid()), str(int(PARENT_DEATH_SIGNAL))
        argv = [sys.executable, "-S", str(_ZYGOTE), guard, signum, sys.executable, "-m", zygote.__name__]
        argv += [str(theirs.fileno()), guard, signum, *self.preload]
        try:
            self.popen = subprocess.Popen(
                argv,
                env=self.env,
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
                pass_fds=[theirs.fileno()],
            )
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        self._sock = ours
        self._ready = asyncio.ensure_future(self._wait_ready(ours, READY_TIMEOUT_S))

    @property
    def importing(self) -> asyncio.Future[bool] | None:
        """The wait for the zygote's imports: its result is False when the zygote failed, died or took over
        READY_TIMEOUT_S. None when the zygote was not started."""
        return self._ready

    async def _wait_ready(self, sock: socket.socket, timeout_s: float) -> bool:
        started = time.monotonic()
        sock.setblocking(False)
        try:
            data = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(sock, 65536), timeout_s)
            doc = json.loads(data) if data else {}
        except (TimeoutError, OSError, ValueError):
            doc = {}
        if not isinstance(doc, dict) or doc.get("ready") is not True:
            self.close(0.0)
            return False
        sock.settimeout(SPAWN_TIMEOUT_S)
        self.info = {**doc, "seconds": round(time.monotonic() - started, 3)}
        return True

    def accepts(self, env: Mapping[str, str]) -> bool:
        """Whether a child with environment `env` may fork from the zygote (module docstring)."""
        ready = self._ready is not None and self._ready.done() and self._ready.result()
        alive = self.popen is not None and self.popen.poll() is None and self._sock is not None
        return bool(ready and alive and import_env(env) == import_env(self.env))

    def spawn(
        self, module: str, env: Mapping[str, str], cwd: Path, stdout: Path, stderr: Path, fds: Sequence[int]
    ) -> ForkedProcess:
        """Fork a child running `module` as `__main__`; the guard's copies of `fds` stay open (close them as
        after Popen). Raises ForkServerError when the zygote refused it or is gone (nothing was started)."""
        if self._sock is None:
            raise ForkServerError("the fork server is not running")
        request = {
            "module": module,
            "env": dict(env),
            "cwd": str(cwd),
            "stdout": str(stdout),
            "stderr": str(stderr),
        }
        try:
            socket.send_fds(self._sock, [json.dumps(request).encode()], list(fds))
            reply = json.loads(self._sock.recv(zygote.MAX_MESSAGE_BYTES) or b"{}")
        except (OSError, ValueError) as exc:
            self.close(0.0)
            raise ForkServerError(f"the fork server failed: {type(exc).__name__}: {exc}") from None
        if "pid" not in reply:
            raise ForkServerError(f"the fork server refused the spawn: {reply.get('error', 'no answer')}")
        return ForkedProcess(int(reply["pid"]))

    def close(self, wait_s: float) -> None:
        """Stop the zygote: EOF on its socket, `wait_s` for it to exit, then SIGKILL. Safe to call many times."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self.popen is None:
            return
        try:
            self.popen.wait(wait_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


class GuardForks:
    """Which of a guard's spawns fork, and from what: its fork roles, its fork server (started at the first spawn
    of a fork role), and the events that say so (`fork_server_ready`, `fork_server_off`, `fork_server_failed`).
    Methods run on the guard's event-loop thread."""

    def __init__(
        self,
        roles: Collection[str],
        preload: Sequence[str],
        env: Mapping[str, str],
        cwd: Path,
        events: EventLog,
    ) -> None:
        """`env`: the fork server's environment (the guard's children's, less what differs between them)."""
        self.roles = frozenset(roles)
        self.preload = tuple(preload)
        self.env = dict(env)
        self.cwd = Path(cwd)
        self.events = events
        self.server: ForkServer | None = None

    @property
    def pid(self) -> int | None:
        return self.server.pid if self.server is not None else None

    async def prepare(self, roles: Collection[str], wait_s: float | None = None) -> None:
        """Before spawning `roles`: when one is a fork role, start the fork server (once, where the guard can
        fork: `fork_refusal`) and wait for its imports, at most `wait_s` (None: until they end, or fail at
        READY_TIMEOUT_S); the imports go on after a shorter wait. A server that cannot start leaves every spawn
        to exec."""
        if self.server is None:
            if not self.roles.intersection(roles):
                return
            if (why := fork_refusal()) is not None:
                self.roles = frozenset()  # said once: every spawn execs
                self.events.emit("fork_server_off", reason=why)
                return
            self.server = ForkServer(self.env, self.cwd, self.preload)
            try:
                self.server.start()
            except OSError as exc:
                self.events.emit("fork_server_failed", error=f"{type(exc).__name__}: {exc}")
                return
            if (started := self.server.importing) is not None:
                started.add_done_callback(self._announce)
        importing = self.server.importing
        if importing is not None and not importing.done():
            try:
                await asyncio.wait_for(asyncio.shield(importing), wait_s)
            except TimeoutError:
                pass  # this spawn execs; the imports go on

    def _announce(self, importing: asyncio.Future[bool]) -> None:
        """`fork_server_ready` once the fork server's imports end, whichever spawn waited for them;
        `fork_server_failed` when it will not fork."""
        if importing.cancelled() or importing.exception() is not None or self.server is None:
            return
        if importing.result():
            info = self.server.info
            fields = {k: info.get(k) for k in ("seconds", "threads", "preloaded")}
            self.events.emit("fork_server_ready", pid=self.server.pid, **fields)
        else:
            why = f"its imports failed, it died, or they took over {READY_TIMEOUT_S:.0f} s: every spawn execs"
            self.events.emit("fork_server_failed", error=f"the fork server did not get ready ({why})")

    def fork(
        self, role: str, module: str, env: Mapping[str, str], out: Path, err: Path, fds: Sequence[int]
    ) -> ForkedProcess | None:
        """The child of `role` forked by the fork server, or None when it is to be exec'ed (module docstring)."""
        if role not in self.roles or self.server is None or not self.server.accepts(env):
            return None
        try:
            return self.server.spawn(module, env, self.cwd, out, err, fds)
        except ForkServerError as exc:
            self.events.emit("fork_server_failed", role=role, error=str(exc))
            return None

    def close(self, wait_s: float = 5.0) -> None:
        """Stop the fork server (its children live on: they are the guard's). Safe to call many times."""
        if self.server is not None:
            self.server.close(wait_s)
