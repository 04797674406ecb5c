"""Bounds every HTTP server of the job applies before a handler runs: the guard, the teacher, the hf rollout
server and the sglang backend (one place, as `runtime/http_auth.py` is for the token).

| bound                        | default (`HttpLimits`)     | answer                                          |
| ---------------------------- | -------------------------- | ----------------------------------------------- |
| idle / header-read time      | `header_timeout_s` = 30 s  | connection closed (aiohttp `keepalive_timeout`) |
| body read time (JSON bodies) | `body_timeout_s` = 60 s    | 408 `body_timeout`, connection closed           |
| body size                    | the app's `client_max_size`| 413 `body_too_large` naming the size            |
| JSON nesting depth           | `max_json_depth` = 64      | 400 `body_too_deep` naming the limit            |
| open connections             | `max_connections` = 256    | 503 `too_many_connections`, connection closed   |
| unread body drained          | `lingering_s` = 1 s        | connection closed (aiohttp `lingering_time`)    |

- The header-read bound is aiohttp's own `keepalive_timeout`: since aiohttp 3.10 it runs from the moment a
  connection opens, so a connection that sends nothing, or half a request head, is closed after it (the
  default of aiohttp is 3630 s). It must exceed the idle time of the job's clients' pooled connections
  (aiohttp's client keeps one 15 s), or a client could reuse a connection the server is closing.
- The body bound covers the bodies a handler reads whole (`request.read()`, `request.json()`): types in
  `BUFFERED_TYPES` (a request without a Content-Type is `application/octet-stream` to aiohttp). The body is
  read here once (aiohttp keeps it for the handler). Streamed frame bodies (`application/x-mopd-tensors`,
  engines/frames/over_http.py) are left to their own socket timeout.
- The depth bound: Python's JSON decoder recurses once per level and raises RecursionError near 1000
  levels, which a handler would report as a 500; a body nested deeper than `max_json_depth` is refused
  before any decoder sees it (`json_too_deep`: a count of brackets outside strings).
- Open connections past `max_connections` get a 503 written on the socket and are closed at once; the
  liveness probe stays fast because held idle connections cost nothing until then and each is closed after
  the header bound.

Errors answer `{"error": <kind>, "message": <sentence naming the bound and the limit>}`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

log = logging.getLogger("mopd_hpc.http")

#: Content types whose bodies handlers read whole (module docstring); other types stream.
BUFFERED_TYPES = frozenset({"application/json", "application/octet-stream", "text/plain"})
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: A JSON string (escapes included) or one bracket; strings are skipped so brackets inside them do not count.
_JSON_TOKEN_RE = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)
_OPEN = frozenset(b"[{")
_CLOSE = frozenset(b"]}")


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """The bounds of one server (module docstring); seconds, counts and levels."""

    header_timeout_s: float = 30.0
    body_timeout_s: float = 60.0
    max_json_depth: int = 64
    max_connections: int = 256
    #: How long a connection whose body was not read whole keeps draining it before it is closed (aiohttp's
    #: `lingering_time`, 10 s by default).
    lingering_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s"):
            if not 0 < getattr(self, name) <= 3600:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: expected 0 < seconds <= 3600")
        for name in ("max_json_depth", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: expected at least 1")

    def runner_kwargs(self) -> dict[str, Any]:
        """aiohttp `AppRunner` settings that carry these bounds (`keepalive_timeout`: the header-read bound;
        `lingering_time`)."""
        return {"keepalive_timeout": self.header_timeout_s, "lingering_time": self.lingering_s}


#: The bounds every server uses unless it is given others (tests give shorter ones).
DEFAULT_LIMITS = HttpLimits()


def error_body(kind: str, message: str) -> dict[str, str]:
    return {"error": kind, "message": message}


def json_too_deep(raw: bytes, limit: int) -> bool:
    """True when the JSON text `raw` opens more than `limit` arrays/objects inside each other.

    Brackets inside strings do not count. O(len(raw)) in C for the scan; Python work only per bracket and
    per string, and none at all when the body holds at most `limit` opening brackets.
    """
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    depth = 0
    for match in _JSON_TOKEN_RE.finditer(raw):
        first = match.group()[0]
        if first in _OPEN:
            depth += 1
            if depth > limit:
                return True
        elif first in _CLOSE:
            depth -= 1
    return False


def loads_bounded(raw: bytes | str, limit: int = DEFAULT_LIMITS.max_json_depth) -> Any:
    """`json.loads` that refuses a text nested deeper than `limit` before decoding it.

    Raises:
        ValueError: too deep (the message names the limit); json.JSONDecodeError (a ValueError): not JSON.
    """
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if json_too_deep(data, limit):
        raise ValueError(f"JSON nests deeper than {limit} levels (the limit of every server of the job)")
    return json.loads(raw)


def limits_middleware(limits: HttpLimits = DEFAULT_LIMITS) -> Any:
    """The middleware that reads a buffered body within `limits.body_timeout_s`, maps a too-large body to
    413 and a too-deep JSON body to 400 (module docstring); install it right after the token check."""

    @web.middleware
    async def bounded_body(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.body_exists and request.content_type in BUFFERED_TYPES:
            try:
                raw = await asyncio.wait_for(request.read(), limits.body_timeout_s)
            except TimeoutError:
                response = web.json_response(
                    error_body(
                        "body_timeout",
                        f"the request body did not arrive within {limits.body_timeout_s:g} s "
                        "(the body-read limit)",
                    ),
                    status=408,
                )
                response.force_close()
                return response
            except web.HTTPRequestEntityTooLarge as exc:
                return web.json_response(error_body("body_too_large", exc.text or exc.reason), status=413)
            if raw.lstrip()[:1] in (b"{", b"[") and json_too_deep(raw, limits.max_json_depth):
                return web.json_response(
                    error_body(
                        "body_too_deep",
                        f"body: JSON nests deeper than {limits.max_json_depth} levels (max_json_depth)",
                    ),
                    status=400,
                )
        return await handler(request)

    return bounded_body


def cap_connections(server: web.Server, limit: int) -> None:
    """Answer 503 and close every connection that would make `server` hold more than `limit` at once.

    Wraps the public `Server.connection_made` hook of this one server object (aiohttp has no setting for it).
    """
    made = server.connection_made
    body = json.dumps(
        error_body(
            "too_many_connections",
            f"the server holds {limit} connections (max_connections): retry when one is closed",
        )
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()

    def connection_made(handler: Any, transport: asyncio.Transport) -> None:
        made(handler, transport)
        if len(server.connections) > limit:
            log.warning("refused a connection: %d open (max_connections=%d)", limit + 1, limit)
            transport.write(head + body)
            # closed on the next loop turn, after the handler's task has started (aiohttp asserts that its
            # manager is still set when the task starts: a close now would clear it first)
            asyncio.get_running_loop().call_soon(transport.close)

    server.connection_made = connection_made  # type: ignore[method-assign]


async def serve_runner(app: web.Application, limits: HttpLimits, **kwargs: Any) -> web.AppRunner:
    """`web.AppRunner(app, **limits.runner_kwargs(), **kwargs)`, set up, its connections capped."""
    runner = web.AppRunner(app, **limits.runner_kwargs(), **kwargs)
    await runner.setup()
    assert runner.server is not None
    cap_connections(runner.server, limits.max_connections)
    return runner
