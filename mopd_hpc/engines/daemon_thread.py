"""A blocking call awaited from asyncio in a daemon thread (weight sync: collectives and AWEX publishes).

Not `asyncio.to_thread`: its executor threads are joined at interpreter exit, so a collective blocked on a
peer that already failed would keep the process alive after the error has been raised. A daemon thread is
abandoned instead; its future settles with the call's result or exception (a late settle after the awaiting
side gave up is dropped).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any


def in_daemon_thread(fn: Callable[..., Any], *args: Any, name: str | None = None) -> asyncio.Future[Any]:
    """Start `fn(*args)` in a daemon thread named `name`; returns a future of the running loop for its result.

    Raises:
        RuntimeError: no running event loop (call it from a coroutine).
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(setter: Callable[[Any], None], value: Any) -> None:
        if not future.done():
            setter(value)

    def run() -> None:
        try:
            value = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            loop.call_soon_threadsafe(settle, future.set_exception, exc)
        else:
            loop.call_soon_threadsafe(settle, future.set_result, value)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
