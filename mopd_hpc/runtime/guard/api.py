"""Request bodies of the guard's HTTP API (JSON), validated strictly: unknown keys and wrong types are 400.

| method | path             | body                                   | answer                               |
| ------ | ---------------- | -------------------------------------- | ------------------------------------ |
| GET    | /health          | –  (the only unauthenticated endpoint) | `{"status": "ok"}`                   |
| GET    | /status          | query `role`, `index`, `generation`    | `{"children": [...], "ports": [...]}`|
| POST   | /ports/reserve   | `ReserveRequest`                       | `{"role", "index", "ports": {n: p}}` |
| POST   | /ports/release   | `SlotRequest`                          | `{"role", "index", "released": {}}`  |
| POST   | /spawn           | `SpawnRequest`                         | 201, the child's status              |
| POST   | /kill            | `KillRequest`                          | the child's status, or state absent  |
| POST   | /shutdown        | `ShutdownRequest`                      | 202 `{"status": "shutting_down"}`    |

Every other request carries `Authorization: Bearer <token>`. Errors answer `{"error": <kind>, "message"}`
with 400 (malformed, or past a bound: `index` <= MAX_CHILD_INDEX, env sizes of spawn_env.py, `gpus` not the
node's, JSON depth of runtime/http_limits.py), 401 (token), 403 (unregistered role, or an env key off
env_policy.py's allow-list), 404, 405, 408 (body too slow), 409 (conflict), 413 (body too large), 503 (too
many connections) or 500 (a bug).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mopd_hpc.runtime import child_env
from mopd_hpc.runtime.http_limits import loads_bounded


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


#: The largest child index a request may name: more children of one role than any job has (a bound, so that
#: an index of 10**20 is a 400 naming it, not a child).
MAX_CHILD_INDEX = 65535
#: The most GPU tokens one spawn may name (the node's own count is checked by the guard: runtime/gpus.py).
MAX_SPAWN_GPUS = 64


class SlotRequest(_Request):
    """A child slot on this node: (role, index)."""

    role: str = Field(min_length=1, max_length=32, description="registered role name, e.g. 'rollout'")
    index: int = Field(
        ge=0,
        le=MAX_CHILD_INDEX,
        description="index of the child within its role on the job (MAX_CHILD_INDEX)",
    )


class ReserveRequest(SlotRequest):
    names: list[str] = Field(min_length=1, max_length=32, description="port names, e.g. ['http', 'nccl']")


class SpawnRequest(SlotRequest):
    env: dict[str, str] = Field(default_factory=dict, description="environment overrides, values verbatim")
    gpus: list[Annotated[str, Field(max_length=128)]] | None = Field(
        default=None,
        max_length=MAX_SPAWN_GPUS,
        description="GPU tokens (indices, GPU-/MIG- ids) of the node's GPUs → CUDA_VISIBLE_DEVICES",
    )
    ports: list[str] = Field(
        default_factory=list, description=f"port names leased for this slot → {child_env.PORT_PREFIX}*"
    )


class KillRequest(SlotRequest):
    wait_s: float | None = Field(default=None, ge=0, le=600, description="SIGTERM→SIGKILL wait, seconds")


class ShutdownRequest(_Request):
    checkpoint: bool = Field(default=False, description="send USR2 to children and wait before teardown")


def describe_validation_error(exc: ValidationError) -> str:
    """A one-line message naming each bad field and what was expected (values of `env` are not echoed)."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        shown = "" if loc.startswith("env") else f" (got {_short(err.get('input'))})"
        parts.append(f"{loc}: {err['msg']}{shown}")
    return "; ".join(parts)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


_M = TypeVar("_M", bound=BaseModel)


async def parse_request(request: web.Request, model: type[_M]) -> _M:
    """Parse the JSON body of `request` into `model`; an HTTP 400 naming the problem otherwise."""
    try:
        data = loads_bounded(await request.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise web.HTTPBadRequest(text=f"body is not valid JSON: {exc}") from None
    except ValueError as exc:  # too deep (the limits middleware refuses it first)
        raise web.HTTPBadRequest(text=f"body: {exc}") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise web.HTTPBadRequest(text=f"{model.__name__}: {describe_validation_error(exc)}") from None
