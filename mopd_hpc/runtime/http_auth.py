"""The job's token and its check on every HTTP server of the job: one aiohttp middleware for the guard, the
teacher, the hf rollout server and the sglang backend (DESIGN.md §4).

The token is a 0600 file in the run directory (records/job_token.py): it never travels in argv, the
environment, a URL or a log line; the guard, the servers and their clients read it from the file and send it as
`Authorization: Bearer <token>`. A request passes when it carries that header (compared in constant
time: `token_matches`). Without it (or with a wrong one) every route answers 401

    {"error": "unauthorized", "message": "missing or wrong token (Authorization: Bearer <token>)"}

with `WWW-Authenticate: Bearer`, unknown paths included (a caller without the token learns nothing of the
routes), except the bare liveness probe: `GET`/`HEAD /health` answers 200 `{"status": "ok"}` itself, the
same on every server, without running the server's handler (which may say more: the teacher's names its
checkpoint, the sglang backend's runs a generation). With the token, `/health` is the server's own handler.

`protect(app, token)` installs the middleware as the outermost one, and right after it the request bounds of
`runtime/http_limits.py` (body read time, body size, JSON depth); `engines/serving.start_app` refuses to
serve an app without the token check (`is_protected`) and applies the connection bounds. Clients send
`auth_headers(token)`.

Standalone servers (a teacher or rollout server started by hand, outside a job) take their token from a
file too (`standalone_token`): the file given, else the run directory's, else a new one in a private
temporary directory; a missing file is created (mode 0600) and its path is logged, never the token.
"""

from __future__ import annotations

import hmac
import logging
import os
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web

from mopd_hpc.records.job_token import create_token_file, read_token_file
from mopd_hpc.records.run_dir import TOKEN_FILE
from mopd_hpc.runtime.http_limits import DEFAULT_LIMITS, HttpLimits, limits_middleware

log = logging.getLogger("mopd_hpc.auth")

#: The HTTP header and scheme that carry the token.
AUTH_HEADER = "Authorization"
AUTH_SCHEME = "Bearer "


def authorization_value(token: str) -> str:
    """The `Authorization` header value for `token`."""
    return AUTH_SCHEME + token


def token_matches(header_value: str | None, token: str) -> bool:
    """Constant-time check of an `Authorization` header value against the job's token."""
    if not header_value or not header_value.startswith(AUTH_SCHEME):
        return False
    return hmac.compare_digest(header_value[len(AUTH_SCHEME) :].encode(), token.encode())


#: The one route a caller without the token may use, and its methods.
LIVENESS_PATH = "/health"
LIVENESS_METHODS = ("GET", "HEAD")
#: What the liveness probe answers without the token: nothing about the server.
LIVENESS_BODY = {"status": "ok"}
#: The 401 answer's body.
UNAUTHORIZED_BODY = {
    "error": "unauthorized",
    "message": "missing or wrong token (Authorization: Bearer <token>)",
}
#: The attribute that marks the token middleware (`is_protected` looks for it).
_MARK = "_mopd_token_check"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def token_middleware(token: str) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """The middleware that requires `token` (module docstring).

    Raises:
        ValueError: `token` is empty (a server must never run with an empty secret).
    """
    if not token:
        raise ValueError(
            "token is empty: a server of the job needs the job's token (the run dir's token file)"
        )

    @web.middleware
    async def require_token(request: web.Request, handler: Handler) -> web.StreamResponse:
        if token_matches(request.headers.get(AUTH_HEADER), token):
            return await handler(request)
        if request.path == LIVENESS_PATH and request.method in LIVENESS_METHODS:
            return web.json_response(LIVENESS_BODY)
        return web.json_response(UNAUTHORIZED_BODY, status=401, headers={"WWW-Authenticate": "Bearer"})

    setattr(require_token, _MARK, True)
    return require_token


def protect(app: web.Application, token: str, limits: HttpLimits = DEFAULT_LIMITS) -> web.Application:
    """Install the token middleware as `app`'s outermost middleware and `limits`' request bounds right after
    it (before the app is frozen); returns `app`.

    Raises:
        ValueError: `token` is empty. RuntimeError (aiohttp): the app is already frozen (serving).
    """
    if not is_protected(app):
        app.middlewares.insert(0, token_middleware(token))
        app.middlewares.insert(1, limits_middleware(limits))
    return app


def is_protected(app: web.Application) -> bool:
    """True when one of `app`'s middlewares is the token check."""
    return any(getattr(m, _MARK, False) for m in app.middlewares)


def auth_headers(token: str | None) -> dict[str, str]:
    """The header that carries `token`; {} for None (a client of a server outside the job)."""
    return {} if token is None else {AUTH_HEADER: authorization_value(token)}


def standalone_token(
    token_file: str | os.PathLike[str] | None, run_dir: str | os.PathLike[str] | None
) -> tuple[str, Path]:
    """(token, its file) for a server started by hand: `token_file`, else `run_dir/guard.token`, else a new
    file in a fresh 0700 temporary directory. A missing file is created with a new token (mode 0600).

    Raises:
        GuardAuthError: the file exists but is empty, readable by others, or owned by another user.
    """
    if token_file is not None:
        path = Path(token_file)
    elif run_dir is not None:
        path = Path(run_dir) / TOKEN_FILE
    else:
        path = Path(tempfile.mkdtemp(prefix="mopd-token-")) / TOKEN_FILE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        create_token_file(path)
        log.info(
            "created token file %s (mode 0600): clients send its content as 'Authorization: Bearer'", path
        )
    return read_token_file(path), path
