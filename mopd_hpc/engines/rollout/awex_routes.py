"""AWEX weight updates on the HF rollout server (issue 8): `add_awex_routes` adds the reader's two endpoints.

    POST /awex/init            {"inference_config": {...}}  (`AwexJobConfig.inference_config(engine_rank)`)
        builds the reader (`awex_hf.hf_awex_engine(inference_config, engine)`) and calls its initialize()
        (it talks to the MetaServer) in a worker thread → 200 {"status": "ok", "engine_rank": i}.
        Again with the same config → 200 with "already": true; with another config → 409 naming the keys.
    POST /awex/update_weights  {"step": int >= 0}
        set_global_step(step), then update_weights() in a worker thread: it blocks until the actor's writer
        sends step `step` (awex_hf sets the engine's weight_version to str(step)) → 200 {"status": "ok",
        "weight_version": "<step>", "seconds": <float, wall seconds of the update>, "spans": {name: seconds}
        (the reader's sub-phases, `awex_spans.py`)}.

Errors (JSON in the server's shape {"success": false, "message", "error": {"message", "type", "code"}}):
400 a bad body (field, value, expectation) or `AwexConfigError`; 409 an update before /awex/init succeeded,
an init with another config, an init or an update while another one runs; 503 `AwexUnavailableError`
(awex or megatron.core missing here); 500 anything else (message "<type>: <text>"). Nothing imports awex
until /awex/init.

Order (awex 0.9.0): the reader's initialize() waits at the MetaServer for the writer's parameter metadata,
which the writer puts only in its first write_weights (`WeightsWriter._initialize`). So /awex/init returns
only once the actor has started its first publish: the caller runs /awex/init while that publish runs, then
/awex/update_weights for the same step (as tests/engines/test_awex_hf_gpu.py's two processes do).

Colocate mode: awex's reader releases the engine's weights in initialize() and resumes them inside each
update (awex/reader/weights_reader.py), so between /awex/init and the first update /generate fails.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web

from mopd_hpc.engines.request_fields import RolloutRequestError, fail, int_field, json_object, reject_unknown
from mopd_hpc.engines.rollout.http_app import read_json_body
from mopd_hpc.engines.weight_sync.awex import AwexConfigError, AwexUnavailableError

log = logging.getLogger("mopd_hpc.rollout")

#: Builds the awex inference engine of a rollout engine: (inference_config, engine) → an object with
#: initialize(), set_global_step(step) and update_weights().
AwexFactory = Callable[[Mapping[str, Any], Any], Any]
_MISSING = object()


class AwexStateError(ValueError):
    """The request does not fit the reader's state (not initialized, initialized with another config, an
    update already running): HTTP 409."""


def default_factory(config: Mapping[str, Any], engine: Any) -> Any:
    """`awex_hf.hf_awex_engine`, imported here so that awex is imported only when a reader is built."""
    from mopd_hpc.engines.weight_sync.awex_hf import hf_awex_engine

    return hf_awex_engine(config, engine)


def parse_init(body: Any) -> dict[str, Any]:
    """The inference_config of an /awex/init body. Raises RolloutRequestError (400) naming the field."""
    body = json_object("body", body)
    reject_unknown("/awex/init body", body, ("inference_config",))
    config = body.get("inference_config")
    if not isinstance(config, Mapping) or not config:
        raise fail("inference_config", config, "a non-empty JSON object (AwexJobConfig.inference_config(i))")
    return dict(config)


def parse_step(body: Any) -> int:
    """The step of an /awex/update_weights body. Raises RolloutRequestError (400) naming `step`."""
    body = json_object("body", body)
    reject_unknown("/awex/update_weights body", body, ("step",))
    return int_field("step", body.get("step"), 0)


def differing_keys(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """Keys whose values differ between two configs (a key present in one only counts), sorted."""
    return sorted(k for k in set(old) | set(new) if old.get(k, _MISSING) != new.get(k, _MISSING))


class AwexRoutes:
    """State and handlers of the AWEX endpoints of one rollout server (module docstring).

    Attributes:
        engine: the served `HFRolloutEngine`; factory: builds the awex engine from (config, engine).
        config: the inference_config of the successful /awex/init, None before.
        awex_engine: the initialized awex engine, None before.
    """

    def __init__(self, engine: Any, factory: AwexFactory) -> None:
        self.engine, self.factory = engine, factory
        self.config: dict[str, Any] | None = None
        self.awex_engine: Any = None
        self.updating: int | None = None  # the step of the running update
        self._init_lock = threading.Lock()  # held by the worker thread for a whole init
        self._update_lock = threading.Lock()  # taken on the event loop, released by the worker thread

    async def init(self, request: web.Request) -> web.Response:
        try:
            config = parse_init(await read_json_body(request))
            already = await asyncio.get_running_loop().run_in_executor(None, self._init_blocking, config)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a JSON error; the server serves on
            return _failure(request, exc)
        rank = config.get("engine_rank")
        return web.json_response(
            {"status": "ok", "engine_rank": rank} | ({"already": True} if already else {})
        )

    def _init_blocking(self, config: dict[str, Any]) -> bool:
        """Build and initialize the reader once; True when it already was, with this same config. An init
        while another runs is refused (awex's initialize() blocks until the actor's first publish)."""
        if not self._init_lock.acquire(blocking=False):
            raise AwexStateError(
                "/awex/init: another /awex/init is still running (awex's reader initialize() waits for the "
                "actor's first publish: its writer sets up in write_weights)"
            )
        try:
            if self.config is not None:
                diff = differing_keys(self.config, config)
                if not diff:
                    return True
                have, want = ({k: c.get(k) for k in diff} for c in (self.config, config))
                raise AwexStateError(
                    f"/awex/init: the AWEX reader is initialized with another inference_config; differing "
                    f"keys {diff} (initialized: {have}, requested: {want}); restart the rollout server to "
                    "change it"
                )
            start = time.perf_counter()
            awex_engine = self.factory(config, self.engine)
            awex_engine.initialize()
            self.awex_engine, self.config = awex_engine, config
            log.info(
                "AWEX reader initialized: engine_rank %s of %s, mode %s, MetaServer %s (%.2f s)",
                config.get("engine_rank"),
                config.get("num_engines"),
                "colocate" if config.get("enable_colocate_mode") else "separate",
                config.get("meta_server_addr"),
                time.perf_counter() - start,
            )
            return False
        finally:
            self._init_lock.release()

    async def update_weights(self, request: web.Request) -> web.Response:
        try:
            step = parse_step(await read_json_body(request))
            awex_engine = self.awex_engine
            if awex_engine is None:
                raise AwexStateError(
                    f"/awex/update_weights step={step}: the AWEX reader is not initialized; "
                    "POST /awex/init first"
                )
            if not self._update_lock.acquire(blocking=False):
                raise AwexStateError(
                    f"/awex/update_weights step={step}: the update of step {self.updating} is still running"
                )
            try:
                self.updating = step
                future = asyncio.get_running_loop().run_in_executor(
                    None, self._update_blocking, awex_engine, step
                )
            except BaseException:
                self._update_lock.release()
                raise
            seconds, spans = await future
        except Exception as exc:  # noqa: BLE001 - every failure becomes a JSON error; the server serves on
            return _failure(request, exc)
        version = str(self.engine.weight_version)
        log.info("AWEX update of step %d received in %.3f s (weight_version %s)", step, seconds, version)
        return web.json_response(
            {"status": "ok", "weight_version": version, "seconds": seconds, "spans": spans}
        )

    def _update_blocking(self, awex_engine: Any, step: int) -> tuple[float, dict[str, float]]:
        """set_global_step then update_weights (blocks until the writer sends); wall seconds and the
        reader's sub-phase seconds (`awex_spans.py`; {} for an engine that keeps none). Frees the update
        slot when done, also when the request that started it went away."""
        try:
            start = time.perf_counter()
            awex_engine.set_global_step(step)
            awex_engine.update_weights()
            return time.perf_counter() - start, dict(getattr(awex_engine, "last_spans", {}))
        finally:
            self.updating = None
            self._update_lock.release()


def add_awex_routes(app: web.Application, engine: Any, *, factory: AwexFactory | None = None) -> AwexRoutes:
    """Register POST /awex/init and POST /awex/update_weights on `app` for `engine` (an HFRolloutEngine).

    Args:
        factory: builds the awex engine from (inference_config, engine); default `awex_hf.hf_awex_engine`
            (imported on the first /awex/init). Tests pass a fake.
    Returns: the routes' state (config and awex engine once initialized).
    """
    routes = AwexRoutes(engine, factory or default_factory)
    app.router.add_post("/awex/init", routes.init)
    app.router.add_post("/awex/update_weights", routes.update_weights)
    return routes


def _failure(request: web.Request, exc: Exception) -> web.Response:
    """The JSON error answer of a failed AWEX request (status per the module docstring)."""
    if isinstance(exc, AwexUnavailableError):
        status, message = 503, str(exc)
    elif isinstance(exc, RolloutRequestError | AwexConfigError):
        status, message = 400, str(exc)
    elif isinstance(exc, AwexStateError):
        status, message = 409, str(exc)
    else:
        log.exception("%s %s failed", request.method, request.path)
        status, message = 500, f"{type(exc).__name__}: {exc}"
    if status != 500:
        log.warning("%s %s -> %d: %s", request.method, request.path, status, message)
    error = {"message": message, "type": type(exc).__name__, "code": status}
    return web.json_response({"success": False, "message": message, "error": error}, status=status)
