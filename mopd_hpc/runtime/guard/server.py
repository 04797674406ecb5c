"""The guard: one aiohttp service per node per job (DESIGN.md §4, Guard; endpoints in `guard/api.py`).

It leases its own HTTP port (owner `<job>/guard/0`, name `http`), binds it on `--bind`, and writes
`run_dir/guards/<host>.json` (`host`, `bind`, `port`, `url`, `pid`, `job_id`) atomically once it serves.
Every endpoint except the bare liveness probe `GET /health` needs the job's token (`runtime/http_auth.py`);
its children get the bind address as MOPD_NODE_ADDR, so their servers listen where the guard does. It spawns
only registered roles (with env overrides on runtime/guard/env_policy.py's allow-list, any other key is a 403
and a `spawn_refused` event; within spawn_env.py's size bounds; on GPUs of this node, runtime/gpus.py
`node_gpus`), under the request bounds of runtime/http_limits.py, leases named ports per (role, index), reports status per (role, index, generation),
kills process groups, and on SIGTERM or SIGUSR2 forwards USR2 to every child's group, waits up to
`checkpoint_wait_s`, kills what is left (each child's whole tree: runtime/guard/children.py), releases every
lease and exits 0 (SIGINT and `POST /shutdown` skip the checkpoint wait unless asked; SIGHUP, its
parent-death signal from the keeper, SIGKILLs every tree at once).
Request logs name method, path and status only: never headers, bodies or env values.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel

from mopd_hpc.atomic import atomic_write_json
from mopd_hpc.runtime.guard.api import (
    KillRequest,
    ReserveRequest,
    ShutdownRequest,
    SlotRequest,
    SpawnRequest,
    parse_request,
)
from mopd_hpc.runtime.guard.children import ChildSupervisor
from mopd_hpc.runtime.guard.config import GUARD_ROLE, GuardConfig
from mopd_hpc.runtime.guard.config import GuardConfigError as GuardConfigError  # re-exported for the CLI
from mopd_hpc.runtime.guard.events import EventLog, events_path
from mopd_hpc.runtime.guard.fork_server import REQUEST_READY_WAIT_S
from mopd_hpc.runtime.guard.keeper import FORWARDED, KEEPER_DEATH_SIGNAL
from mopd_hpc.runtime.guard.roles import RoleModuleMissingError, UnregisteredRoleError
from mopd_hpc.runtime.guard.spawn_env import ChildEnvError, spawn_refusal
from mopd_hpc.runtime.http_auth import token_middleware
from mopd_hpc.runtime.http_limits import limits_middleware, serve_runner
from mopd_hpc.runtime.ports import (
    PortInUseError,
    PortLeaseError,
    PortLeaser,
    PortOwner,
    PortsExhaustedError,
)
from mopd_hpc.runtime.signals import CHECKPOINT_SIGNAL, EXIT_OK, signal_name

log = logging.getLogger("mopd_hpc.guard")

#: How long the HTTP server waits for in-flight requests when it stops.
_HTTP_SHUTDOWN_S = 2.0
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_M = TypeVar("_M", bound=BaseModel)
#: Port errors → (HTTP status, error kind); most specific first.
PORT_ERROR_STATUS: tuple[tuple[type[PortLeaseError], int, str], ...] = (
    (PortsExhaustedError, 409, "ports_exhausted"),
    (PortInUseError, 409, "port_in_use"),
    (PortLeaseError, 400, "bad_port_request"),
)


def _error(status: int, kind: str, message: str) -> web.Response:
    return web.json_response({"error": kind, "message": message}, status=status)


class Guard:
    """The guard service. `await start()`, then `await wait_stopped()`; `teardown()` stops it."""

    def __init__(self, config: GuardConfig, token: str) -> None:
        self.config = config
        self.leaser = PortLeaser(config.lease_policy)
        self.events = EventLog(events_path(config.run_dir, config.host), config.host)
        self.children = ChildSupervisor(
            config.run_dir,
            config.host,
            config.job_id,
            self.events,
            config.base_env,
            node_addr=config.bind,
            site_env_keys=config.site_env_keys,
            fork_roles=config.fork_roles,
            preload=config.preload,
        )
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._stopped = asyncio.Event()
        self._teardown_task: asyncio.Task[None] | None = None
        self._signals_seen: set[int] = set()
        #: The signal that started the teardown, if one did (autostart turns it into 128 + signum).
        self.stop_signal: int | None = None
        # the token check (runtime/http_auth.py) and the request bounds (runtime/http_limits.py) inside the
        # error middleware, which logs every answer
        self.app = web.Application(
            middlewares=[self._errors, token_middleware(token), limits_middleware(config.http_limits)]
        )
        self.app.add_routes(
            [
                web.get("/health", self._health),
                web.get("/status", self._status),
                web.post("/ports/reserve", self._reserve),
                web.post("/ports/release", self._release),
                web.post("/spawn", self._spawn),
                web.post("/kill", self._kill),
                web.post("/shutdown", self._shutdown),
            ]
        )

    # ---- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Lease and bind the HTTP port, serve, install signal handlers, write the guard file."""
        cfg = self.config
        self.events.emit("guard_start", pid=_pid(), job_id=cfg.job_id)
        owner = PortOwner.create(cfg.job_id, GUARD_ROLE, 0)
        if cfg.port:
            lease = self.leaser.reserve_port(owner, "http", cfg.port)
        else:
            lease = self.leaser.reserve(owner, ["http"])["http"]
        self.port = lease.port
        sock = socket.socket(socket.AF_INET6 if ":" in cfg.bind else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((cfg.bind, self.port))
        self._runner = await serve_runner(
            self.app, cfg.http_limits, access_log=None, shutdown_timeout=_HTTP_SHUTDOWN_S
        )
        await web.SockSite(self._runner, sock, shutdown_timeout=_HTTP_SHUTDOWN_S).start()
        loop = asyncio.get_running_loop()
        for signum, checkpoint in ((signal.SIGTERM, True), (CHECKPOINT_SIGNAL, True), (signal.SIGINT, False)):
            loop.add_signal_handler(signum, self._on_signal, signum, checkpoint)
        loop.add_signal_handler(KEEPER_DEATH_SIGNAL, self._on_keeper_death)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)  # blocked since keeper.fork_guard: now handled
        url_host = cfg.host if cfg.bind in ("0.0.0.0", "::") else cfg.bind
        url = f"http://{'[' + url_host + ']' if ':' in url_host else url_host}:{self.port}"
        record = {"host": cfg.host, "bind": cfg.bind, "port": self.port, "url": url, "pid": _pid()}
        cfg.guard_file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(cfg.guard_file, {**record, "job_id": cfg.job_id, "started_ts": time.time()})
        self.events.emit("guard_ready", **record)
        log.info("guard ready: %s (pid %d)", url, _pid())

    async def wait_stopped(self) -> int:
        await self._stopped.wait()
        if self._runner is not None:
            await self._runner.cleanup()
        self.events.close()
        return EXIT_OK

    def _on_signal(self, signum: int, checkpoint: bool) -> None:
        if signum in self._signals_seen:  # the keeper forwards what Slurm also sent us: act once
            return
        self._signals_seen.add(signum)
        if self._teardown_task is None and self.stop_signal is None:
            self.stop_signal = signum
        self.events.emit("guard_signal", signal=signal_name(signum), pid=_pid())
        log.info("guard got %s: tearing down (checkpoint=%s)", signal_name(signum), checkpoint)
        self.start_teardown(checkpoint)

    def _on_keeper_death(self) -> None:
        """The keeper (our parent, runtime/guard/keeper.py) is gone, or the terminal hung up: nobody would
        clean up after us, so every child's tree is SIGKILLed now, our lease copies closed first (a child
        holds its own until it dies), then the teardown reaps and stops."""
        if self._teardown_task is None and self.stop_signal is None:
            self.stop_signal = KEEPER_DEATH_SIGNAL
        self.events.emit("guard_signal", signal=signal_name(KEEPER_DEATH_SIGNAL), pid=_pid())
        log.warning(
            "guard got %s (its keeper is gone): killing every child's tree now",
            signal_name(KEEPER_DEATH_SIGNAL),
        )
        self.leaser.close()
        self.children.kill_all_now()
        self.start_teardown(checkpoint=False)

    @property
    def stopping(self) -> bool:
        """True once the teardown has started (signal, `POST /shutdown`, or `start_teardown`)."""
        return self._teardown_task is not None

    async def wait_teardown(self) -> None:
        """Wait until a teardown has started and finished (children killed, leases released)."""
        await self._stopped.wait()

    def start_teardown(self, checkpoint: bool) -> asyncio.Task[None]:
        if self._teardown_task is None:
            self._teardown_task = asyncio.get_running_loop().create_task(self._teardown(checkpoint))
        return self._teardown_task

    async def _teardown(self, checkpoint: bool) -> None:
        cfg, sup = self.config, self.children
        try:
            running = sup.running()
            if checkpoint and running:
                for child in running:
                    await sup.signal_group(child, CHECKPOINT_SIGNAL)
                await asyncio.gather(*(sup.wait_gone(c, cfg.checkpoint_wait_s) for c in running))
            await asyncio.gather(*(sup.kill(c, cfg.kill_wait_s) for c in sup.all()))
            sup.forks.close()
            await sup.sweep(cfg.kill_wait_s)  # what left its children's trees, wherever it went
        finally:
            sup.forks.close()
            self.leaser.close()
            with contextlib.suppress(FileNotFoundError):
                cfg.guard_file.unlink()
            self.events.emit("guard_stop", pid=_pid())
            self._stopped.set()

    # ---- middlewares -------------------------------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            response = await handler(request)
        except web.HTTPMethodNotAllowed as exc:
            allowed = ", ".join(sorted(exc.allowed_methods))
            response = _error(405, "method_not_allowed", f"{request.method} {request.path}: use {allowed}")
        except web.HTTPNotFound:
            response = _error(404, "not_found", f"Not Found: no endpoint {request.method} {request.path}")
        except web.HTTPException as exc:
            response = _error(exc.status, exc.reason.lower().replace(" ", "_"), exc.text or exc.reason)
        except PortLeaseError as exc:
            status, kind = next((st, k) for cls, st, k in PORT_ERROR_STATUS if isinstance(exc, cls))
            response = _error(status, kind, str(exc))
        except Exception as exc:  # the guard keeps serving whatever one request does
            log.exception("guard: %s %s failed", request.method, request.path)
            response = _error(500, "internal", f"{type(exc).__name__}: {exc}")
        log.info("%s %s -> %d", request.method, request.path, response.status)
        return response

    # ---- handlers ----------------------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _status(self, request: web.Request) -> web.Response:
        q = request.query
        try:
            index = int(q["index"]) if "index" in q else None
            generation = int(q["generation"]) if "generation" in q else None
        except ValueError:
            return _error(400, "bad_request", f"index/generation must be integers, got {dict(q)}")
        children = [
            c.to_dict()
            for c in self.children.all()
            if ("role" not in q or c.role == q["role"])
            and (index is None or c.index == index)
            and (generation is None or c.generation == generation)
        ]
        ports = [
            {
                "role": x.owner.role,
                "index": x.owner.index,
                "name": x.name,
                "port": x.port,
                "generation": x.generation,
            }
            for x in self.leaser.leases()
        ]
        return web.json_response({"host": self.config.host, "children": children, "ports": ports})

    async def _reserve(self, request: web.Request) -> web.Response:
        req = await parse_request(request, ReserveRequest)
        owner = self._owner(req)
        leases = self.leaser.reserve(owner, req.names)
        return web.json_response(
            {"role": req.role, "index": req.index, "ports": {n: x.port for n, x in leases.items()}}
        )

    async def _release(self, request: web.Request) -> web.Response:
        req = await parse_request(request, SlotRequest)
        released = self.leaser.release(self._owner(req))
        return web.json_response({"role": req.role, "index": req.index, "released": _ports(released)})

    async def _spawn(self, request: web.Request) -> web.Response:
        req = await parse_request(request, SpawnRequest)
        if self._teardown_task is None and req.role in self.config.roles.modules:
            # before the checks: nothing runs between them
            await self.children.forks.prepare([req.role], REQUEST_READY_WAIT_S)
        if self._teardown_task is not None:
            return _error(409, "shutting_down", "the guard is shutting down: nothing new is spawned")
        try:
            module = self.config.roles.module_for(req.role)
        except UnregisteredRoleError as exc:
            return _error(403, "forbidden", str(exc))
        except RoleModuleMissingError as exc:
            return _error(409, "role_module_missing", str(exc))
        current = self.children.latest(req.role, req.index)
        if current is not None and not current.exited.is_set():
            return _error(
                409,
                "already_running",
                f"{req.role}/{req.index} generation {current.generation} is running (pid {current.pid}): "
                "kill it first",
            )
        owner = self._owner(req)
        # before any lease or process: nothing is left behind
        refusal = spawn_refusal(req.env, req.gpus, self.config.node_gpus, self.config.site_env_keys)
        if refusal is not None:
            keys = sorted(req.env)
            self.events.emit("spawn_refused", role=req.role, index=req.index, reason=refusal[2], keys=keys)
            log.warning("guard: spawn of %s/%d refused: %s", req.role, req.index, refusal[2])
            return _error(*refusal)
        generation = self.children.next_generation(req.role, req.index)
        leases = self.leaser.reserve(owner, req.ports, generation) if req.ports else {}
        try:
            child = self.children.spawn(req.role, req.index, module, req.env, req.gpus, leases)
        except ChildEnvError as exc:
            self.leaser.release(owner, generation)
            return _error(400, "bad_env", str(exc))
        except OSError as exc:
            self.leaser.release(owner, generation)
            if exc.errno == errno.E2BIG:  # the guard's own environment plus the overrides: past ARG_MAX
                return _error(400, "bad_env", f"env: the child's environment is too large to exec ({exc})")
            raise
        self.leaser.note_child(owner, child.pid, generation)
        return web.json_response(child.to_dict(), status=201)

    async def _kill(self, request: web.Request) -> web.Response:
        req = await parse_request(request, KillRequest)
        owner = self._owner(req)
        child = self.children.latest(req.role, req.index)
        gone = True
        if child is not None:
            gone = await self.children.kill(
                child, self.config.kill_wait_s if req.wait_s is None else req.wait_s
            )
        # Only this generation's leases (and older ones): a spawn of the next generation may have come in
        # while this kill waited for the group, and its leases are its own.
        released = _ports(self.leaser.release(owner, child.generation if child is not None else None))
        if not gone:
            assert child is not None
            tail = self.children.tail(child.stderr)
            return _error(
                500,
                "kill_failed",
                f"{req.role}/{req.index} process group {child.pgid} survived SIGKILL; "
                f"stderr {child.stderr} ends with:\n{tail}",
            )
        body = (
            child.to_dict()
            if child is not None
            else {"role": req.role, "index": req.index, "state": "absent"}
        )
        return web.json_response({**body, "released": released})

    async def _shutdown(self, request: web.Request) -> web.Response:
        body = await request.read()
        req = await parse_request(request, ShutdownRequest) if body.strip() else ShutdownRequest()
        self.start_teardown(req.checkpoint)
        return web.json_response({"status": "shutting_down"}, status=202)

    def _owner(self, req: SlotRequest) -> PortOwner:
        if req.role == GUARD_ROLE:
            raise web.HTTPForbidden(
                text=f"role {GUARD_ROLE!r} is the guard itself: its leases are not for clients"
            )
        return PortOwner.create(self.config.job_id, req.role, req.index)


def _pid() -> int:
    return os.getpid()


def _ports(leases: list[Any]) -> dict[str, int]:
    return {x.name: x.port for x in leases}
