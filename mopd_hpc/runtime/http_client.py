"""What the job's HTTP clients (the teacher client, the rollout client) share: one bound on a whole call, and
the close of their session.

aiohttp's own total timeout stops at the answer's headers and body as aiohttp reads them; a frame read straight
from the socket (`engines/frames/over_http.read_frame`), a client's retries and their backoff lie outside it.
`within_deadline` bounds all of it with `asyncio.timeout` and raises no answer within the bound as the client's
own "unavailable" error, in one wording:

    <where>: no answer within <total_s> s (its request timeout, <field>): the server is stopped, hung or overloaded

`SessionClient` closes the client's `aiohttp.ClientSession` at the end of `async with`, or at `close()`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aiohttp

T = TypeVar("T")


async def within_deadline(
    call: Awaitable[T],
    total_s: float | None,
    *,
    where: str,
    field: str,
    unavailable: Callable[[str], Exception],
) -> T:
    """Await `call` within `total_s` seconds (None: unbounded) and return its result.

    Args:
        where: names the server and the request ("teacher 'a' replica 0 at http://h:p: /score").
        field: the config field that sets the bound ("rollout.request_timeout_s").
        unavailable: the client's error type, built from the message.

    Raises:
        the `unavailable(message)` error, chained from the TimeoutError, when the bound passes or the call
        itself raises a TimeoutError (aiohttp's total, its ServerTimeoutError); what else the call raises
        passes through unchanged.
    """
    try:
        async with asyncio.timeout(total_s):
            return await call
    except TimeoutError as exc:
        within = "" if total_s is None else f" within {total_s:g} s"
        raise unavailable(
            f"{where}: no answer{within} (its request timeout, {field}): the server is stopped, hung or "
            "overloaded"
        ) from exc


class SessionClient:
    """Mixin of a client that holds one `aiohttp.ClientSession` in `_session` (None while none is open):
    `async with` ends with `close()`, which closes the session (idempotent; a later call opens a new one where
    the client opens it lazily)."""

    _session: aiohttp.ClientSession | None = None

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
