"""A blocking client of one guard (plain `urllib`: usable from any thread, no event loop needed).

Timeouts on every call; retries with backoff when the guard cannot be reached. Requests that did reach
the guard are retried only when they are idempotent (status, reserve, release, kill): a spawn whose answer
was lost is reconciled with `status()`, never blindly resent. Errors are typed and carry the guard's
HTTP status and response text.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from mopd_hpc.records.job_token import read_token_file
from mopd_hpc.records.run_dir import guard_record_file
from mopd_hpc.runtime.http_auth import AUTH_HEADER, authorization_value


class GuardError(RuntimeError):
    """A guard call failed."""


class GuardUnreachableError(GuardError):
    """No answer from the guard after every retry (connection refused, reset, or timed out)."""


class GuardHTTPError(GuardError):
    """The guard answered with an error status; `status`, `kind` and `text` are its answer."""

    def __init__(self, method: str, url: str, status: int, text: str) -> None:
        self.status = status
        self.text = text
        try:
            body = json.loads(text)
            self.kind, self.message = str(body.get("error")), str(body.get("message"))
        except (ValueError, AttributeError):
            self.kind, self.message = "unknown", text
        super().__init__(f"{method} {url} -> {status} {self.kind}: {self.message}")


class GuardUnauthorizedError(GuardHTTPError):
    """401: missing or wrong token."""


class GuardForbiddenError(GuardHTTPError):
    """403: the role is not a registered entry point, or an env key is refused (env_policy.py)."""


class GuardBadRequestError(GuardHTTPError, ValueError):
    """400: the request was malformed (the message names the field)."""


class GuardConflictError(GuardHTTPError):
    """409: already running, shutting down, ports exhausted or in use, role module missing."""


_BY_STATUS: dict[int, type[GuardHTTPError]] = {
    400: GuardBadRequestError,
    401: GuardUnauthorizedError,
    403: GuardForbiddenError,
    409: GuardConflictError,
}


def read_guard_file(run_dir: str | os.PathLike[str], host: str) -> dict[str, Any]:
    """The guard's address record `run_dir/guards/<host>.json` (`url`, `host`, `port`, `pid`, `job_id`)."""
    path = guard_record_file(run_dir, host)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise GuardUnreachableError(
            f"no guard record at {path}: is the guard for host {host!r} up?"
        ) from None


class GuardClient:
    """Calls one guard at `url` with the job's token.

    Args:
        timeout_s: per-request socket timeout, seconds.
        retries: extra attempts after a failed connection (idempotent calls also after a timeout or 5xx).
        backoff_s: first wait between attempts (doubles each time).
    """

    def __init__(
        self, url: str, token: str, *, timeout_s: float = 30.0, retries: int = 3, backoff_s: float = 0.2
    ) -> None:
        self.url = url.rstrip("/")
        self._token = token
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        # The guard is on this node or the cluster network: never through an HTTP proxy from the env.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def __repr__(self) -> str:  # never shows the token
        return f"GuardClient({self.url!r})"

    @classmethod
    def from_run_dir(
        cls, run_dir: str | os.PathLike[str], host: str, token_file: str | os.PathLike[str], **kwargs: Any
    ) -> GuardClient:
        """Find the guard of `host` through its record in the run directory."""
        return cls(read_guard_file(run_dir, host)["url"], read_token_file(token_file), **kwargs)

    # ---- endpoints ---------------------------------------------------------------------------------
    def health(self) -> bool:
        """True when the guard answers its liveness probe."""
        return self._call("GET", "/health", None, idempotent=True, auth=False).get("status") == "ok"

    def status(
        self, role: str | None = None, index: int | None = None, generation: int | None = None
    ) -> dict[str, Any]:
        """`{"host", "children": [child status...], "ports": [{"role","index","name","port"}...]}`."""
        query = {
            k: v for k, v in (("role", role), ("index", index), ("generation", generation)) if v is not None
        }
        path = "/status" + ("?" + urllib.parse.urlencode(query) if query else "")
        return self._call("GET", path, None, idempotent=True)

    def reserve(self, role: str, index: int, names: Sequence[str]) -> dict[str, int]:
        """Lease named ports for (role, index); idempotent. Returns name → port."""
        body = {"role": role, "index": index, "names": list(names)}
        return self._call("POST", "/ports/reserve", body, idempotent=True)["ports"]

    def release(self, role: str, index: int) -> dict[str, int]:
        """Release every lease of (role, index); idempotent. Returns the released name → port."""
        return self._call("POST", "/ports/release", {"role": role, "index": index}, idempotent=True)[
            "released"
        ]

    def spawn(
        self,
        role: str,
        index: int,
        *,
        env: Mapping[str, str] | None = None,
        gpus: Sequence[str] | None = None,
        ports: Sequence[str] = (),
    ) -> dict[str, Any]:
        """Start the next generation of (role, index); returns its status (pid, generation, ports, logs)."""
        body: dict[str, Any] = {"role": role, "index": index, "env": dict(env or {}), "ports": list(ports)}
        if gpus is not None:
            body["gpus"] = [str(g) for g in gpus]
        return self._call("POST", "/spawn", body, idempotent=False)

    def kill(self, role: str, index: int, wait_s: float | None = None) -> dict[str, Any]:
        """Kill (role, index)'s process group and release its ports; idempotent."""
        body: dict[str, Any] = {"role": role, "index": index}
        if wait_s is not None:
            body["wait_s"] = wait_s
        return self._call("POST", "/kill", body, idempotent=True)

    def shutdown(self, checkpoint: bool = False) -> None:
        """Ask the guard to tear down (children checkpoint first when `checkpoint`) and exit."""
        self._call("POST", "/shutdown", {"checkpoint": checkpoint}, idempotent=True)

    # ---- transport ---------------------------------------------------------------------------------
    def _call(
        self, method: str, path: str, body: Any, *, idempotent: bool, auth: bool = True
    ) -> dict[str, Any]:
        url = self.url + path
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        if auth:
            headers[AUTH_HEADER] = authorization_value(self._token)
        delay, last = self.backoff_s, ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(delay)
                delay *= 2
            request = urllib.request.Request(url, data=data, headers=headers, method=method)
            try:
                with self._opener.open(request, timeout=self.timeout_s) as resp:
                    return json.loads(resp.read() or b"{}")
            except urllib.error.HTTPError as exc:
                text = exc.read().decode("utf-8", errors="replace")
                if exc.code >= 500 and idempotent and attempt < self.retries:
                    last = f"{exc.code}: {text}"
                    continue
                raise _BY_STATUS.get(exc.code, GuardHTTPError)(method, url, exc.code, text) from None
            except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
                reason = getattr(exc, "reason", exc)
                last = f"{type(reason).__name__}: {reason}"
                refused = isinstance(reason, ConnectionRefusedError)
                if not (idempotent or refused):
                    raise GuardUnreachableError(
                        f"{method} {url}: {last}; the request may have reached the guard: "
                        "check status() before retrying"
                    ) from None
        raise GuardUnreachableError(f"{method} {url}: no answer after {self.retries + 1} attempts ({last})")
