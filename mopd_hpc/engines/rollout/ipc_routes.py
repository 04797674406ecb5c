"""Shared-buffer weight updates on the HF rollout server (weight_sync.backend: ipc, `engines/weight_sync/ipc.py`).

    POST /update_weights_from_ipc  `IpcUpdateRequest` JSON {buffers, tensors, weight_version}
        maps each buffer once (cached by buffer_id), copies every slot into its parameter under the
        engine's lock (`HFRolloutEngine.load_named_tensors`: all or nothing, an unknown name or a shape
        mismatch refused naming it) → 200 {"success": true, "weight_version", "seconds": {"map", "copy"},
        "buffers_opened": <buffers mapped since the server started>}.
    POST /get_weights_by_name  {"name": str, "truncate_size": int = 100}  (SGLang's)
        the first truncate_size elements of one parameter, flattened, as a JSON list (exact for float32
        and bf16): a check route, not a transport.

Both sit behind the job's token like every route (`hf_server.rollout_app` → `http_auth.protect`); errors
are the server's JSON (`http_app._errors`: 400 a bad body or weight, 500 a bug).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import web

from mopd_hpc.engines.request_fields import fail, int_field, json_object, reject_unknown
from mopd_hpc.engines.rollout.http_app import read_json_body

log = logging.getLogger("mopd_hpc.rollout")


class IpcRoutes:
    """State of one server's shared-buffer updates: the engine and the mapped buffers (`BufferMap`)."""

    def __init__(self, engine: Any) -> None:
        from mopd_hpc.engines.weight_sync.ipc import BufferMap

        self.engine, self.buffers = engine, BufferMap()
        self._lock = asyncio.Lock()  # one update at a time: the mapping cache is not shared between them

    async def update(self, request: web.Request) -> web.Response:
        from mopd_hpc.engines.weight_sync.ipc import IpcUpdateRequest

        req = IpcUpdateRequest.from_json(await read_json_body(request))
        async with self._lock:
            map_s, copy_s = await asyncio.to_thread(self._load, req)
        log.info("loaded %d tensors from shared buffers in %.4f s, weight_version=%s", len(req.tensors),
                 map_s + copy_s, self.engine.weight_version)  # fmt: skip
        return web.json_response({
            "success": True, "message": f"loaded {len(req.tensors)} tensors",
            "weight_version": self.engine.weight_version, "seconds": {"map": map_s, "copy": copy_s},
                "buffers_opened": self.buffers.opened,
        })  # fmt: skip

    def _load(self, req: Any) -> tuple[float, float]:
        import torch

        t0 = time.perf_counter()
        views = self.buffers.views(req)
        t1 = time.perf_counter()
        self.engine.load_named_tensors(views, req.weight_version)
        device = getattr(self.engine, "device", None)
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)  # the copies are done before the actor may overwrite the buffer
        return t1 - t0, time.perf_counter() - t1

    async def get_weights(self, request: web.Request) -> web.Response:
        body = json_object("body", await read_json_body(request))
        reject_unknown("/get_weights_by_name body", body, ("name", "truncate_size"))
        name, size = body.get("name"), int_field("truncate_size", body.get("truncate_size", 100), 1)
        state = self.engine.model.state_dict()
        if name not in state:
            raise fail("name", name, f"a parameter of the model (e.g. {', '.join(list(state)[:3])})")
        return web.json_response(state[name].detach().reshape(-1)[:size].float().cpu().tolist())


def add_ipc_routes(app: web.Application, engine: Any) -> IpcRoutes:
    """Register POST /update_weights_from_ipc and POST /get_weights_by_name on `app` for `engine`."""
    routes = IpcRoutes(engine)
    app.router.add_post("/update_weights_from_ipc", routes.update)
    app.router.add_post("/get_weights_by_name", routes.get_weights)
    return routes
