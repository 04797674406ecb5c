"""HTTP handlers of the rollout server (SGLang 0.5.23's RL subset); `hf_server.py` runs them.

Errors are JSON {"success": false, "message", "error": {"message", "type", "code"}}: 400 for a bad
request (field, value, expectation), 409 when the engine is busy, 503 while weights are released, 500 for
a bug (the server keeps serving). Control endpoints answer {"success": true, "message", ...}.

`POST /memory_peaks`: the engine's peak GPU memory per phase since the last call (`engines/memory/peaks.py`:
/generate in `rollout`; weight updates and memory release/resume, AWEX's too, in `sync`; {} on CPU).

/generate answers SGLang's JSON, or one binary frame (`generate_wire.py`: output ids and log-probs as
tensors) when the request's Accept header names application/x-mopd-tensors (DESIGN.md §7).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from aiohttp import web

from mopd_hpc.engines.frames.over_http import accepts_frame, send_frame
from mopd_hpc.engines.memory.peaks import PeakTracker, add_peaks_route, peak_middleware
from mopd_hpc.engines.request_fields import RolloutRequestError
from mopd_hpc.engines.rollout.control import (
    PAUSE_MODES,
    MemoryTagsRequest,
    add_memory_routes,
    add_weight_routes,
)
from mopd_hpc.engines.rollout.generate_wire import GeneratedBatch
from mopd_hpc.engines.rollout.protocol import GenerateRequest
from mopd_hpc.engines.rollout.server_args import ServerArgs
from mopd_hpc.engines.weight_sync.requests import (
    DEFAULT_GROUP_NAME,
    DistributedUpdateRequest,
    InitGroupRequest,
)

log = logging.getLogger("mopd_hpc.rollout")

#: How long a memory release waits for the running batch, in seconds.
IDLE_WAIT_S = 60.0


class ServiceUnavailableError(RuntimeError):
    """The request cannot be served in the current state (weights released): HTTP 503."""


def _error(status: int, exc: BaseException | str) -> web.Response:
    message = str(exc)
    kind = type(exc).__name__ if isinstance(exc, BaseException) else "Error"
    body = {"success": False, "message": message, "error": {"message": message, "type": kind, "code": status}}
    return web.json_response(body, status=status)


def _ok(message: str, **extra: Any) -> web.Response:
    return web.json_response({"success": True, "message": message} | extra)


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Turn every failure into a JSON error response; the server never crashes on a request."""
    from mopd_hpc.engines.rollout.hf_engine import WeightLoadError
    from mopd_hpc.engines.rollout.scheduler import EngineBusyError

    try:
        return await handler(request)
    except (RolloutRequestError, WeightLoadError) as exc:
        return _error(400, exc)
    except EngineBusyError as exc:
        return _error(409, exc)
    except ServiceUnavailableError as exc:
        return _error(503, exc)
    except web.HTTPException as exc:
        return _error(exc.status, exc.reason or str(exc))
    except Exception as exc:  # noqa: BLE001 - a bug in a handler must not take the server down
        log.exception("%s %s failed", request.method, request.path)
        return _error(500, exc)


async def read_json_body(request: web.Request) -> Any:
    """The request's JSON body ({} when empty). Raises RolloutRequestError on malformed JSON."""
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RolloutRequestError(f"malformed JSON body: {exc}") from exc


#: The phase of the step each tracked route runs in (`engines/memory/peaks.py`).
PHASE_OF_PATH = {
    "/generate": "rollout",
    **{
        path: "sync"
        for path in (
            "/release_memory_occupation",
            "/resume_memory_occupation",
            "/update_weights_from_distributed",
            "/update_weights_from_disk",
            "/awex/update_weights",
            "/update_weights_from_ipc",
        )
    },
}


class RolloutServer:
    """State and handlers of one server: the engine, its scheduler, released tags, weight-sync groups."""

    def __init__(self, args: ServerArgs, engine: Any, tokenizer: Any = None) -> None:
        from mopd_hpc.engines.rollout.scheduler import GenerationScheduler

        self.args, self.engine, self.tokenizer = args, engine, tokenizer
        self.scheduler = GenerationScheduler(engine, args.max_batch_rows)
        self.released: set[str] = set()
        self.groups: dict[str, Any] = {}
        self.rng = random.Random(args.random_seed)
        self.peaks = PeakTracker(getattr(engine, "device", None))

    def app(self) -> web.Application:
        track = peak_middleware(self.peaks, PHASE_OF_PATH)
        app = web.Application(middlewares=[_errors, track], client_max_size=1 << 30)
        r = app.router
        add_peaks_route(r, self.peaks)
        for path in ("/health", "/health_generate", "/ready"):
            r.add_get(path, self.health)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        r.add_get("/server_info", self.server_info)
        r.add_post("/generate", self.generate)
        r.add_put("/generate", self.generate)
        r.add_post("/pause_generation", self.pause)
        r.add_post("/continue_generation", self.resume)
        add_memory_routes(r, self.release, self.resume_memory, self.flush_cache)
        add_weight_routes(
            r, self.init_group, self.update_from_distributed, self.destroy_group, self.update_from_disk
        )
        return app

    # ---- info --------------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(self.engine.info())

    async def server_info(self, request: web.Request) -> web.Response:
        state = self.scheduler.status() | {
            "released_tags": sorted(self.released),
            "weight_update_groups": sorted(self.groups),
            "weight_version": self.engine.weight_version,
            "device_memory_allocated_bytes": self.engine.device_memory_allocated(),
        }
        return web.json_response(asdict(self.args) | {"internal_states": [state]})

    # ---- generation --------------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.Response:
        from mopd_hpc.engines.rollout.rows import RowRequest

        req = GenerateRequest.from_json(await read_json_body(request))
        if "weights" in self.released:
            raise ServiceUnavailableError("weights are released: POST /resume_memory_occupation first")
        if req.return_routed_experts and not self.engine.routing.moe:
            raise RolloutRequestError(
                f"return_routed_experts: the model at {self.args.model_path!r} is dense (no MoE router)"
            )
        prompts = req.prompts if req.prompts is not None else self._tokenize(req.texts or ())
        vocab = self.engine.vocab_size
        for i, (ids, sp) in enumerate(zip(prompts, req.sampling, strict=True)):
            bad = [t for t in ids + sp.stop_token_ids if t >= vocab]
            if bad:
                raise RolloutRequestError(
                    f"input_ids[{i}] / stop_token_ids: token id {bad[0]} >= vocab_size {vocab}"
                )
        rows, owners = [], []
        for i, (ids, sp) in enumerate(zip(prompts, req.sampling, strict=True)):
            for j in range(sp.n):
                seed = sp.sampling_seed + j if sp.sampling_seed is not None else self.rng.getrandbits(62)
                rows.append(
                    RowRequest(
                        ids,
                        sp,
                        seed,
                        req.return_logprob,
                        req.logprob_start_len,
                        req.top_logprobs_num,
                        req.return_routed_experts,
                    )
                )
                owners.append((i, j))
        start = time.perf_counter()
        results = await self.scheduler.submit(rows)
        latency = time.perf_counter() - start
        binary = accepts_frame(request)
        items = [self._item(req, rows[k], res, owners[k], latency, binary) for k, res in enumerate(results)]
        is_batch = req.is_batch or len(items) > 1
        if binary:
            lps = [res.output_logprobs for res in results] if req.return_logprob else None
            routed = [res.routed_experts for res in results] if req.return_routed_experts else None
            answer = GeneratedBatch.from_results(
                items, [res.output_ids for res in results], lps, is_batch, routed
            )
            return await send_frame(request, answer.layout())
        return web.json_response(items if is_batch else items[0])

    def _tokenize(self, texts: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        if self.tokenizer is None:
            raise RolloutRequestError(
                f"text: the model at {self.args.model_path!r} has no tokenizer; send input_ids"
            )
        return tuple(tuple(self.tokenizer.encode(t, add_special_tokens=False)) for t in texts)

    def _item(
        self, req: GenerateRequest, row: Any, res: Any, owner: tuple[int, int], latency: float, binary: bool
    ) -> dict:
        """One SGLang response item; `binary`: without output_ids and output_token_logprobs (they travel
        as tensors)."""
        i, j = owner
        rid = req.rids[i] if req.rids else uuid.uuid4().hex
        meta: dict[str, Any] = {
            "id": rid if row.sampling.n == 1 else f"{rid}-{j}",
            "finish_reason": res.finish,
            "prompt_tokens": len(row.prompt_ids),
            "completion_tokens": len(res.output_ids),
            "cached_tokens": 0,
            "weight_version": res.weight_version,
            "e2e_latency": latency,
        }
        if req.return_routed_experts and not binary:  # [|output|][M][k] expert ids
            meta["routed_experts"] = [t.tolist() for t in res.routed_experts]
        if req.return_logprob and not binary:
            meta["output_token_logprobs"] = [
                [lp, t, None] for lp, t in zip(res.output_logprobs, res.output_ids, strict=True)
            ]
        if req.return_logprob:
            meta["input_token_logprobs"] = [
                [lp, row.prompt_ids[len(row.prompt_ids) - len(res.input_logprobs) + k], None]
                for k, lp in enumerate(res.input_logprobs)
            ]
            if req.top_logprobs_num:
                meta["output_top_logprobs"] = [[[lp, t, None] for lp, t in top] for top in res.output_top]
                meta["input_top_logprobs"] = [
                    None if top is None else [[lp, t, None] for lp, t in top] for top in res.input_top
                ]
        text = self.tokenizer.decode(res.output_ids) if self.tokenizer is not None else ""
        if binary:
            return {"text": text, "meta_info": meta}
        return {"text": text, "output_ids": res.output_ids, "meta_info": meta}

    async def pause(self, request: web.Request) -> web.Response:
        body = await read_json_body(request)
        if not isinstance(body, dict) or set(body) - {"mode"}:
            raise RolloutRequestError(
                f"/pause_generation body={body!r}: expected {{'mode': one of {list(PAUSE_MODES)}}}"
            )
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise RolloutRequestError(f"mode={mode!r}: expected one of {list(PAUSE_MODES)}")
        self.scheduler.pause(mode)
        return _ok(f"generation paused (mode={mode})")

    async def resume(self, request: web.Request) -> web.Response:
        await read_json_body(request)
        self.scheduler.resume()
        return _ok("generation continued")

    # ---- memory ------------------------------------------------------------------------------------

    async def release(self, request: web.Request) -> web.Response:
        tags = MemoryTagsRequest.from_json(await read_json_body(request)).tags
        async with self.scheduler.exclusive(IDLE_WAIT_S):
            done = []
            for tag in tags:
                if tag in self.released:
                    done.append(f"{tag}: already released")
                    continue
                if tag == "weights":
                    done.append(f"weights: {await asyncio.to_thread(self.engine.offload_weights)}")
                else:
                    done.append(f"{tag}: nothing held between requests by the hf backend (no-op)")
                self.released.add(tag)
        log.info("release_memory_occupation %s: %s", list(tags), "; ".join(done))
        return _ok("; ".join(done), released_tags=sorted(self.released))

    async def resume_memory(self, request: web.Request) -> web.Response:
        tags = MemoryTagsRequest.from_json(await read_json_body(request)).tags
        missing = [t for t in tags if t not in self.released]
        if missing:
            raise RolloutRequestError(
                f"tags={list(tags)}: {missing} not released (released: {sorted(self.released)}); "
                f"resume only what /release_memory_occupation released"
            )
        done = []
        for tag in tags:
            if tag == "weights":
                done.append(f"weights: {await asyncio.to_thread(self.engine.onload_weights)}")
            else:
                done.append(f"{tag}: resumed (no-op)")
            self.released.discard(tag)
        log.info("resume_memory_occupation %s: %s", list(tags), "; ".join(done))
        return _ok("; ".join(done), released_tags=sorted(self.released))

    async def flush_cache(self, request: web.Request) -> web.Response:
        return _ok("the hf backend keeps no cache between requests")

    # ---- weights -----------------------------------------------------------------------------------

    async def init_group(self, request: web.Request) -> web.Response:
        from mopd_hpc.engines.weight_sync.torch import BroadcastGroup

        req = InitGroupRequest.from_json(await read_json_body(request))
        if req.group_name in self.groups:
            raise RolloutRequestError(f"group_name={req.group_name!r}: already initialised; destroy it first")
        if req.backend == "nccl" and self.engine.device.type != "cuda":
            raise RolloutRequestError(f"backend='nccl': the model is on {self.engine.device}; use 'gloo'")
        device = self.engine.device if req.backend == "nccl" else "cpu"
        self.groups[req.group_name] = None  # reserved while joining
        try:
            group = await asyncio.to_thread(
                BroadcastGroup.join, req.master_address, req.master_port, req.rank_offset, req.world_size,
                req.group_name, req.backend, device, self.args.weight_sync_timeout_s,
            )  # fmt: skip
        except BaseException:
            del self.groups[req.group_name]
            raise
        self.groups[req.group_name] = group
        return _ok(f"joined {req.group_name!r} as rank {req.rank_offset}/{req.world_size} ({req.backend})")

    def _group(self, name: str) -> Any:
        group = self.groups.get(name)
        if group is None:
            raise RolloutRequestError(
                f"group_name={name!r}: no such weight-update group (have {sorted(self.groups)})"
            )
        return group

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        from mopd_hpc.engines.weight_sync.torch import TensorSpec, receive_tensors

        req = DistributedUpdateRequest.from_json(await read_json_body(request))
        group = self._group(req.group_name)
        if req.abort_all_requests:
            self.scheduler.abort_all()
        specs = [TensorSpec(n, d, s) for n, d, s in zip(req.names, req.dtypes, req.shapes, strict=True)]
        tensors = await asyncio.to_thread(receive_tensors, group, specs, req.load_format)
        count = await asyncio.to_thread(self.engine.load_named_tensors, tensors, req.weight_version)
        log.info(
            "loaded %d tensors from group %r, weight_version=%s",
            count,
            req.group_name,
            self.engine.weight_version,
        )
        return _ok(f"loaded {count} tensors", weight_version=self.engine.weight_version)

    async def destroy_group(self, request: web.Request) -> web.Response:
        body = await read_json_body(request)
        if not isinstance(body, dict) or set(body) - {"group_name"}:
            raise RolloutRequestError(
                f"/destroy_weights_update_group body={body!r}: expected {{'group_name': str}}"
            )
        name = body.get("group_name", DEFAULT_GROUP_NAME)
        group = self._group(name)
        del self.groups[name]
        await asyncio.to_thread(group.close)
        log.info("left weight-sync group %r", name)
        return _ok(f"left {name!r}")

    async def update_from_disk(self, request: web.Request) -> web.Response:
        body = await read_json_body(request)
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
            raise RolloutRequestError(
                f"/update_weights_from_disk body={body!r}: expected {{'model_path': str, ...}}"
            )
        if not os.path.isdir(body["model_path"]):
            raise RolloutRequestError(f"model_path={body['model_path']!r}: not a directory")
        version = body.get("weight_version")
        if body.get("abort_all_requests"):
            self.scheduler.abort_all()
        count = await asyncio.to_thread(
            self.engine.load_from_disk, body["model_path"], None if version is None else str(version)
        )
        return _ok(f"loaded {count} tensors from {body['model_path']}", num_paused_requests=0)
