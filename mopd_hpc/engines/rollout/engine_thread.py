"""One daemon thread that makes every call to an in-process `sglang.Engine`, in the order they were asked.

Why one thread: SGLang 0.5.17's Engine drives its tokenizer manager on an event loop of its own
(`Engine.loop`: every synchronous method is `self.loop.run_until_complete(...)`), and the tokenizer
manager's reply loop, its request locks and the events its callers wait on belong to the loop that first ran
them. Generation on the server's loop and memory or weight calls on the Engine's loop in other threads would
each wait for replies that the other loop receives (an `asyncio.Event` set from a foreign thread does not
wake its loop). Every call from the thread that built the Engine, through its synchronous methods, is what
ran on the lead's H100 probe (benchmarks/sglang_probe.py). Requests to the server are then served one Engine
call at a time: the trainer sends one batch per engine per phase.

A daemon thread (not an executor's, which interpreter exit joins: `engines/daemon_thread.py`): an Engine call
blocked on a failed scheduler must not keep the role from exiting.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any


def _settle(future: asyncio.Future[Any], value: Any, failed: bool) -> None:
    if not future.done():  # the awaiting side may have given up (cancelled)
        (future.set_exception if failed else future.set_result)(value)


class EngineThread:
    """The thread (module docstring). `await call(fn, *args, **kw)` runs `fn(*args, **kw)` there and returns
    its result or raises its exception; `close()` ends the thread after the calls already asked."""

    def __init__(self, name: str = "sglang-engine") -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def ident(self) -> int | None:
        """The thread's identifier (`threading.get_ident()` inside it)."""
        return self._thread.ident

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args, kwargs, loop, future = job
            try:
                value, failed = fn(*args, **kwargs), False
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                value, failed = exc, True
            loop.call_soon_threadsafe(_settle, future, value, failed)

    async def call(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._jobs.put((fn, args, kwargs, loop, future))
        return await future

    def close(self) -> None:
        self._jobs.put(None)
