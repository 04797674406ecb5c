"""Batching of /generate requests onto one worker thread, with SGLang's pause semantics.

Requests are split into rows (one per prompt copy) and queued; the worker takes up to `max_batch_rows`
queued rows at a time, whatever request they belong to, and decodes them as one batch. A request's
future resolves when all its rows are done.

Pause (`/pause_generation`, SGLang 0.5.23 semantics):
- "abort": running rows end at the next step with finish_reason abort (partial output kept), queued rows
  end at once with an empty output; requests arriving while paused wait.
- "in_place" and "retract": running rows stop between two steps and keep their KV cache; queued and new
  requests wait. (The hf backend treats "retract" as "in_place": it keeps the cache instead of freeing
  and recomputing it; the tokens produced are the same.)
`resume()` (`/continue_generation`) lets everything proceed.

After each batch the engine's cached blocks go back to the device (`HFRolloutEngine.release_cache`): in a
colocated job the KV cache is the rollout phase's only (plan/memory_plan.py).

`exclusive()` holds new batches back and waits for the running one to finish, for operations that need
an idle engine (memory release); it raises `EngineBusyError` when rows are paused in place.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from mopd_hpc.engines.rollout.hf_engine import HFRolloutEngine
from mopd_hpc.engines.rollout.rows import RowRequest, RowResult

log = logging.getLogger(__name__)


class EngineBusyError(RuntimeError):
    """The operation needs an idle engine and rows are running or paused in place (HTTP 409)."""


@dataclass(slots=True)
class _Job:
    rows: Sequence[RowRequest]
    future: asyncio.Future[list[RowResult]]
    loop: asyncio.AbstractEventLoop
    results: list[RowResult | None] = field(default_factory=list)
    remaining: int = 0


@dataclass(frozen=True, slots=True)
class _Pending:
    job: _Job
    index: int


class GenerationScheduler:
    """Owns the worker thread that runs `engine.generate`. Start with `start()`, end with `stop()`."""

    def __init__(self, engine: HFRolloutEngine, max_batch_rows: int) -> None:
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows={max_batch_rows}: expected >= 1")
        self.engine = engine
        self.max_batch_rows = max_batch_rows
        self._cond = threading.Condition()
        self._queue: collections.deque[_Pending] = collections.deque()
        self._running: list[_Pending] = []
        self._paused = False
        self._pause_mode = "abort"
        self._abort_epoch = 0
        self._batch_epoch = 0
        self._holds = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._work, name="rollout-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._abort_epoch += 1
            self._cond.notify_all()
        self._thread.join(timeout=30)

    # ---- asyncio side ------------------------------------------------------------------------------

    async def submit(self, rows: Sequence[RowRequest]) -> list[RowResult]:
        """Queue `rows` and wait for their results (in order)."""
        loop = asyncio.get_running_loop()
        job = _Job(rows=rows, future=loop.create_future(), loop=loop, results=[None] * len(rows))
        job.remaining = len(rows)
        with self._cond:
            self._queue.extend(_Pending(job, i) for i in range(len(rows)))
            self._cond.notify_all()
        return await job.future

    def pause(self, mode: str) -> None:
        with self._cond:
            self._paused, self._pause_mode = True, mode
            if mode == "abort":
                self._abort_epoch += 1
                aborted = list(self._queue)
                self._queue.clear()
            else:
                aborted = []
            self._cond.notify_all()
        for pending in aborted:
            result = RowResult(weight_version=self.engine.weight_version)
            result.finish = {"type": "abort", "message": "aborted by /pause_generation"}
            self._deliver(pending, result)
        log.info("generation paused (mode=%s, %d queued rows aborted)", mode, len(aborted))

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()
        log.info("generation continued")

    def abort_all(self) -> None:
        """Abort running and queued rows without pausing (abort_all_requests of a weight update)."""
        paused, mode = self._paused, self._pause_mode
        self.pause("abort")
        with self._cond:
            self._paused, self._pause_mode = paused, mode
            self._cond.notify_all()

    def status(self) -> dict[str, object]:
        with self._cond:
            return {
                "paused": self._paused,
                "pause_mode": self._pause_mode if self._paused else None,
                "num_running_reqs": len(self._running),
                "num_waiting_reqs": len(self._queue),
            }

    @contextlib.asynccontextmanager
    async def exclusive(self, timeout_s: float) -> AsyncIterator[None]:
        """Hold new batches back and wait (at most timeout_s) until no row runs."""
        with self._cond:
            self._holds += 1
        try:
            ok = await asyncio.to_thread(self._wait_idle, timeout_s)
            if not ok:
                raise EngineBusyError(
                    f"{len(self._running)} rows still running after {timeout_s}s "
                    f"(paused={self._paused}, mode={self._pause_mode}): the operation needs an idle engine"
                )
            yield
        finally:
            with self._cond:
                self._holds -= 1
                self._cond.notify_all()

    def _wait_idle(self, timeout_s: float) -> bool:
        with self._cond:
            if self._running and self._paused and self._pause_mode != "abort":
                return False
            return self._cond.wait_for(lambda: not self._running, timeout=timeout_s)

    # ---- worker thread -----------------------------------------------------------------------------

    def between_steps(self) -> bool:
        """StepGate: False aborts the running batch; blocks while paused in place."""
        with self._cond:
            while self._paused and self._pause_mode != "abort" and self._batch_epoch == self._abort_epoch:
                self._cond.wait()
            return self._batch_epoch == self._abort_epoch and not self._stopping

    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: self._stopping or (self._queue and not self._paused and not self._holds)
                )
                if self._stopping:
                    return
                batch = [self._queue.popleft() for _ in range(min(self.max_batch_rows, len(self._queue)))]
                self._running = batch
                self._batch_epoch = self._abort_epoch
            try:
                results = self.engine.generate([p.job.rows[p.index] for p in batch], gate=self)
                for pending, result in zip(batch, results, strict=True):
                    self._deliver(pending, result)
            except BaseException as exc:  # noqa: BLE001 - delivered to every waiting request
                log.exception("generation batch of %d rows failed", len(batch))
                for job in {id(p.job): p.job for p in batch}.values():
                    with contextlib.suppress(RuntimeError):
                        job.loop.call_soon_threadsafe(_set_exception, job.future, exc)
            finally:
                release = getattr(self.engine, "release_cache", None)
                if release is not None:  # the batch's KV cache back to the device (`HFRolloutEngine`)
                    release()
                with self._cond:
                    self._running = []
                    self._cond.notify_all()

    def _deliver(self, pending: _Pending, result: RowResult) -> None:
        job = pending.job
        with self._cond:
            job.results[pending.index] = result
            job.remaining -= 1
            done = job.remaining == 0
        if done:
            with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody waits any more
                job.loop.call_soon_threadsafe(_set_result, job.future, job.results)


def _set_result(future: asyncio.Future, value: object) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
