"""The sglang backend's HTTP server: the rollout surface of DESIGN.md §5 over an in-process `sglang.Engine`.

The launch and mapping rules (named ports, environment, readiness, request and response shapes) are
`sglang_backend.py`'s; this module serves them:

  GET  /health /health_generate      SGLang's generating probe (one token); 503 while weights are released
  GET  /model_info /server_info      model_path, backend; the launch arguments and released tags
  POST /generate                     input_ids, sampling_params, return_logprob (SGLang's JSON answer)
  GET|POST /release_memory_occupation, /resume_memory_occupation {tags}; /flush_cache
  POST /init_weights_update_group, /update_weights_from_distributed, /destroy_weights_update_group
  POST /update_weights_from_disk {model_path, weight_version?}
  POST /update_weights_from_ipc {buffers, tensors, weight_version}   a colocated actor's shared buffers
                                     (weight_sync.backend ipc), into `Engine.update_weights_from_tensor`
                                     as references the TP workers open (`sglang_ipc.py`)
  POST /memory_peaks                 the GPU memory of this child's process tree (SGLang's schedulers
                                     included) per phase since the last call (`tree_memory.py`; {} without NVML)

Every route calls the Engine's synchronous Python method of the same name (`generate` for /generate and the
probe), with SGLang 0.5.17's signatures (`srt/entrypoints/engine.py`), on the server's one engine thread
(`engine_thread.py`: the thread that built the Engine; SGLang's tokenizer manager lives on the Engine's own
loop): a broadcast that waits for the trainer does not stop the server answering, and the Engine's methods
(`self.loop.run_until_complete(...)`) never run on the thread of the server's running loop. The engine's TP
workers join the torch weight-sync group as ranks rank_offset … rank_offset + tp_size − 1 (the trainer gives
each server tp_size ranks: engines/weight_sync/torch.py `ranks_per_server`).

Weight version: SGLang 0.5.17's Engine methods take no `weight_version` (its request records do; its HTTP
server passes them), so SGLang answers "default" in every item (measured on an H100, the lead's probe). The
server is the only writer of the Engine's weights: it keeps the version of the last successful update and
answers it in every generated item's `meta_info.weight_version` (`generate`) and in /model_info, so each
rollout names the step whose weights sampled it (the controller updates weights between phases, never
during a generation).

Memory: when a colocated step leaves ROLLOUT the trainer releases kv_cache, weights and cuda_graph, and
resumes weights before the weight sync and kv_cache and cuda_graph after it (trainer/rollout_memory.py); a
repeated release, or a resume of what is held, touches nothing here (SGLang itself raises on both). Every route but the bare liveness probe requires the job's token (`sglang_app`, runtime/http_auth.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from aiohttp import web

from mopd_hpc.engines.memory.peaks import add_peaks_route, peak_middleware
from mopd_hpc.engines.request_fields import RolloutRequestError
from mopd_hpc.engines.rollout.control import MemoryTagsRequest, add_memory_routes, add_weight_routes
from mopd_hpc.engines.rollout.engine_thread import EngineThread
from mopd_hpc.engines.rollout.protocol import GenerateRequest
from mopd_hpc.engines.rollout.sglang_backend import (
    SGLangBackendError,
    SGLangLaunch,
    check_environment,
    check_item,
    generate_kwargs,
    ports_from_env,
)
from mopd_hpc.engines.rollout.tree_memory import PHASE_OF_PATH, TreeMemoryTracker
from mopd_hpc.engines.weight_sync.requests import (
    DEFAULT_GROUP_NAME,
    DistributedUpdateRequest,
    InitGroupRequest,
)
from mopd_hpc.records.job_token import GuardAuthError
from mopd_hpc.runtime.http_auth import protect, standalone_token

log = logging.getLogger("mopd_hpc.engines.rollout.sglang")


class SGLangRolloutServer:
    """The HTTP surface over an `sglang.Engine` (or any object with its Python API: generate,
    release_memory_occupation, resume_memory_occupation, flush_cache, init_weights_update_group,
    update_weights_from_distributed, update_weights_from_tensor, update_weights_from_disk; get_server_info
    and destroy_weights_update_group where it has them)."""

    def __init__(
        self, launch: SGLangLaunch, engine: Any, thread: EngineThread | None = None, memory: Any = None
    ) -> None:
        """`thread`: the one that built `engine` and makes every call to it (a new one when None); `memory`:
        the per-phase memory tracker (default `tree_memory.TreeMemoryTracker()` of this process's tree)."""
        self.launch, self.engine = launch, engine
        self.thread = thread or EngineThread()
        self.memory = TreeMemoryTracker() if memory is None else memory
        self.released: set[str] = set()
        self.weight_version = "default"
        #: Weights resumed and not loaded since: SGLang's memory saver keeps no copy of released weights, so
        #: they are garbage until the next update (the lead's H100 probe: greedy output changed, μ off by
        #: up to 1.48 nats). Generation is refused (503) until an update has loaded them.
        self.stale_weights = False

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=1 << 30, middlewares=[peak_middleware(self.memory, PHASE_OF_PATH)]
        )
        r = app.router
        add_peaks_route(r, self.memory)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        r.add_get("/model_info", self.model_info)
        r.add_get("/server_info", self.server_info)
        r.add_post("/generate", self.generate)
        add_memory_routes(r, self.release, self.resume_memory, self.flush_cache)
        add_weight_routes(
            r, self.init_group, self.update_from_distributed, self.destroy_group, self.update_from_disk
        )
        r.add_post("/update_weights_from_ipc", self.update_from_ipc)
        return app

    async def health(self, request: web.Request) -> web.Response:
        """SGLang's generating probe: one token from a one-token prompt; 503 while weights are released or
        stale (`stale_weights`)."""
        if self.released or self.stale_weights:
            return web.json_response({"error": self._not_ready()}, status=503)
        out = await self.thread.call(
            self.engine.generate, input_ids=[0], sampling_params={"max_new_tokens": 1}
        )
        return web.Response(status=200 if out else 503)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.launch.model_path,
                "is_generation": True,
                "backend": "sglang",
                "weight_version": self.weight_version,
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        info = self.engine.get_server_info() if hasattr(self.engine, "get_server_info") else {}
        return web.json_response(
            {"launch": asdict(self.launch), "released_tags": sorted(self.released), **info}
        )

    async def generate(self, request: web.Request) -> web.Response:
        try:
            req = GenerateRequest.from_json(await request.json())
            kwargs = generate_kwargs(req)
        except (RolloutRequestError, ValueError) as exc:
            return _error(400, str(exc))
        if "weights" in self.released or self.stale_weights:
            return _error(503, self._not_ready())
        out = await self.thread.call(self.engine.generate, **kwargs)
        items = out if isinstance(out, list) else [out]
        for k, item in enumerate(items):  # validate every item against the documented shape
            check_item(item, kwargs["input_ids"][k], req.return_logprob, req.logprob_start_len)
            item["meta_info"]["weight_version"] = self.weight_version  # module docstring
        return web.json_response(items if req.is_batch or len(items) > 1 else items[0])

    async def release(self, request: web.Request) -> web.Response:
        tags = MemoryTagsRequest.from_json(await _json(request)).tags
        todo = [t for t in tags if t not in self.released]  # idempotent: SGLang raises on a repeated tag
        if todo:
            await self.thread.call(self.engine.release_memory_occupation, tags=todo)
            self.released.update(todo)
        return web.json_response({"success": True, "released": sorted(self.released)})

    async def resume_memory(self, request: web.Request) -> web.Response:
        tags = MemoryTagsRequest.from_json(await _json(request)).tags
        todo = [t for t in tags if t in self.released]
        if todo:
            await self.thread.call(self.engine.resume_memory_occupation, tags=todo)
            self.released.difference_update(todo)
            self.stale_weights |= "weights" in todo
        return web.json_response({"success": True, "released": sorted(self.released)})

    def _not_ready(self) -> str:
        if self.released:
            return f"released: {sorted(self.released)}"
        return "weights resumed but not loaded since (SGLang's memory saver keeps no copy): a weight update first"

    async def flush_cache(self, request: web.Request) -> web.Response:
        await self.thread.call(self.engine.flush_cache)
        return web.json_response({"success": True})

    # ---- weights ------------------------------------------------------------------------------------

    async def init_group(self, request: web.Request) -> web.Response:
        """Join the trainer's weight-update group (the Engine's TP workers as ranks rank_offset + tp_rank)."""
        try:
            req = InitGroupRequest.from_json(await _json(request))
        except RolloutRequestError as exc:
            return _error(400, str(exc))
        if req.rank_offset + self.launch.tp_size > req.world_size:
            return _error(
                400,
                f"rank_offset={req.rank_offset} + tp_size={self.launch.tp_size} > world_size={req.world_size}: "
                "the trainer must give this server tp_size ranks",
            )
        return await self._engine_call("init_weights_update_group", **req.to_json())

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        """Receive one broadcast of the named tensors; weight_version becomes the request's.
        (abort_all_requests is not SGLang 0.5.17 Engine's: the controller updates between phases only.)"""
        try:
            req = DistributedUpdateRequest.from_json(await _json(request))
        except RolloutRequestError as exc:
            return _error(400, str(exc))
        kwargs = {k: v for k, v in req.to_json().items() if k not in ("weight_version", "abort_all_requests")}
        kwargs.setdefault("load_format", None)
        return await self._engine_call("update_weights_from_distributed", req.weight_version, **kwargs)

    async def update_from_ipc(self, request: web.Request) -> web.Response:
        """A colocated actor's shared buffers into the Engine (`sglang_ipc.py`): 200 {"success",
        "weight_version", "seconds": {"map": 0 (nothing is mapped here), "copy": the Engine's update}}."""
        from mopd_hpc.engines.rollout.sglang_ipc import named_refs
        from mopd_hpc.engines.weight_sync.ipc import IpcUpdateRequest

        try:
            req = IpcUpdateRequest.from_json(await _json(request))
        except RolloutRequestError as exc:
            return _error(400, str(exc))
        t0 = time.perf_counter()
        answer = await self._engine_call(
            "update_weights_from_tensor", req.weight_version,
            named_tensors=named_refs(req), load_format=None, flush_cache=True,
        )  # fmt: skip
        if answer.status != 200:
            return answer
        log.info("sglang: %d tensors from shared buffers in %.4f s, weight_version=%s", len(req.tensors),
                 time.perf_counter() - t0, self.weight_version)  # fmt: skip
        return web.json_response({
            "success": True, "message": f"loaded {len(req.tensors)} tensors",
            "weight_version": self.weight_version,
            "seconds": {"map": 0.0, "copy": time.perf_counter() - t0},
        })  # fmt: skip

    async def destroy_group(self, request: web.Request) -> web.Response:
        body = await _json(request)
        group = (
            body.get("group_name", DEFAULT_GROUP_NAME) if isinstance(body, Mapping) else DEFAULT_GROUP_NAME
        )
        if not hasattr(self.engine, "destroy_weights_update_group"):
            return web.json_response(
                {"success": True, "message": "the engine keeps its group until shutdown"}
            )
        return await self._engine_call("destroy_weights_update_group", group_name=group)

    async def update_from_disk(self, request: web.Request) -> web.Response:
        body = await _json(request)
        if not isinstance(body, Mapping) or not isinstance(body.get("model_path"), str):
            return _error(
                400, f"/update_weights_from_disk body={body!r}: expected {{'model_path': str, ...}}"
            )
        version = body.get("weight_version")
        return await self._engine_call(
            "update_weights_from_disk",
            None if version is None else str(version),
            model_path=body["model_path"],
        )

    async def _engine_call(
        self, method: str, weight_version: str | None = None, **kwargs: Any
    ) -> web.Response:
        """Run `engine.<method>(**kwargs)` on the engine thread; SGLang answers (success, message). A weight
        update that succeeded with a `weight_version` makes it the server's (module docstring)."""
        out = await self.thread.call(getattr(self.engine, method), **kwargs)
        success, message = (out[0], out[1]) if isinstance(out, tuple) and len(out) >= 2 else (True, "")
        if not success:
            return _error(400, f"{method}: {message}")
        if method.startswith("update_weights"):
            self.stale_weights = False
        if weight_version is not None:
            self.weight_version = weight_version
        return web.json_response({"success": True, "message": message})


def sglang_app(server: SGLangRolloutServer, token: str) -> web.Application:
    """The backend's app as it is served: `SGLangRolloutServer.app()` behind `token` (`http_auth.protect`)."""
    return protect(server.app(), token)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"success": False, "error": {"message": message}}, status=status)


async def _json(request: web.Request) -> Any:
    raw = await request.read()
    return {} if not raw.strip() else await request.json()


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """`python -m mopd_hpc.engines.rollout.sglang_server --model DIR [--tp N] [--awex] [--token-file F]`;
    ports from env. Every route but the liveness probe requires the token of `--token-file` (created when
    missing; default: a new one in a private temporary directory; its path is logged)."""
    import os

    env = dict(os.environ if environ is None else environ)
    p = argparse.ArgumentParser(prog="python -m mopd_hpc.engines.rollout.sglang_server")
    p.add_argument("--model", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--base-gpu-id", type=int, default=0)
    p.add_argument("--mem-fraction-static", type=float, default=0.5)
    p.add_argument("--awex", action="store_true", help="install AWEX's worker hooks before the Engine")
    p.add_argument("--token-file", default=None, help="0600 token file (created when missing)")
    ns = p.parse_args(argv)
    try:
        check_environment(env)
        launch = SGLangLaunch.from_ports(
            ns.model, ports_from_env(env), tp_size=ns.tp, base_gpu_id=ns.base_gpu_id,
            mem_fraction_static=ns.mem_fraction_static, awex=ns.awex,
        )  # fmt: skip
        token, token_file = standalone_token(ns.token_file, None)
    except (SGLangBackendError, GuardAuthError) as exc:
        print(f"sglang backend: {exc}", file=sys.stderr)
        return 2
    thread = EngineThread()  # builds the Engine and makes every call to it (engine_thread.py)
    engine = asyncio.run(thread.call(start_engine, launch))
    log.info("sglang engine up: %s (token file %s)", " ".join(launch.to_argv()), token_file)
    app = sglang_app(SGLangRolloutServer(launch, engine, thread), token)
    web.run_app(app, host=launch.host, port=launch.port)
    asyncio.run(thread.call(engine.shutdown))
    thread.close()
    return 0


def start_engine(launch: SGLangLaunch) -> Any:
    """`sglang.Engine(**launch.engine_kwargs())`, AWEX's worker hooks installed first when `launch.awex`.

    Raises:
        SGLangBackendError: sglang (or, with AWEX, awex) does not import here.
    """
    try:
        import sglang
    except ImportError as exc:
        raise SGLangBackendError(
            f"rollout.backend sglang: the sglang package does not import here ({exc}); install sglang "
            "on the rollout nodes, or set rollout.backend: hf"
        ) from None
    if launch.awex:
        from awex.engine.sglang import install_sglang_worker_hooks  # needs megatron.core too (awex 0.9.0)

        install_sglang_worker_hooks()
    return sglang.Engine(**launch.engine_kwargs())


if __name__ == "__main__":
    raise SystemExit(main())
