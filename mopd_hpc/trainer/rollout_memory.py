"""The rollout engines' memory at the phase boundaries (DESIGN.md §5): released when the step leaves ROLLOUT,
resumed for the weight sync and the next rollout.

A colocated sglang engine holds a static share of its GPU (weights, KV pool, CUDA graphs:
`SGLangLaunch.mem_fraction_static`) through every phase unless it is told to give it back; the teachers and
the actor's train step need that memory on the same GPU. Per step, the controller calls (SGLang 0.5.23
`/release_memory_occupation` and `/resume_memory_occupation` with tags, in the order verl and AReaL use):

    ROLLOUT ends     release(clients)         tags kv_cache, weights, cuda_graph   (every engine)
    SYNC, before     resume_weights(clients)  tags weights    (the broadcast loads into the engine's weights)
    SYNC, after      resume_cache(clients)    tags kv_cache, cuda_graph   (the next rollout and evaluation)

so between two rollouts the engine holds nothing on the GPU but during the sync, where it holds its weights
only. An engine is released only after every row of the step has come back (the rollout phase awaits them
all), so no request is running (SGLang asserts an idle scheduler).

When: `rollout.mode: colocated` with `rollout.backend: sglang` (`RolloutMemory.from_config`). The hf backend
is not moved: it frees its KV cache and sampling buffers after each batch itself (`HFRolloutEngine.
release_cache`) and keeps its weights, as the memory plan counts them (`plan/memory_plan.py`); a separated
engine has its GPUs to itself. Otherwise every call here is a no-op.

Errors: a server that refuses raises `RolloutServerError` (its status and message) and ends the step (the
step's ABORT; the run stops, as for any failed engine).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

log = logging.getLogger("mopd_hpc.trainer")

#: Released when the step leaves ROLLOUT (SGLang's GPU_MEMORY_TYPE_* names).
RELEASED_TAGS = ("kv_cache", "weights", "cuda_graph")
#: Resumed before the weight sync: the broadcast writes into the engine's weights.
SYNC_TAGS = ("weights",)
#: Resumed after the weight sync, before the next rollout.
CACHE_TAGS = ("kv_cache", "cuda_graph")
#: rollout.backend → whether its engines give their memory back between rollouts when colocated.
RELEASING_BACKENDS = {"sglang": True, "hf": False}


class RolloutMemory:
    """Release/resume of every rollout engine's memory (module docstring); `active` False: every call a no-op.

    Attributes:
        active: whether the engines are moved at all.
        calls: (action, tags) in the order they were sent, one entry per call to all engines (for logs and
            tests).
    """

    def __init__(self, active: bool) -> None:
        self.active = active
        self.calls: list[tuple[str, tuple[str, ...]]] = []

    @classmethod
    def from_config(cls, cfg: Any) -> RolloutMemory:
        """Active for `rollout.mode: colocated` with a backend of `RELEASING_BACKENDS` (sglang)."""
        return cls(cfg.rollout.mode == "colocated" and RELEASING_BACKENDS.get(cfg.rollout.backend, False))

    async def release(self, clients: Sequence[Any]) -> None:
        """The step leaves ROLLOUT: every engine releases `RELEASED_TAGS`."""
        await self._each(clients, "release", RELEASED_TAGS)

    async def resume_weights(self, clients: Sequence[Any]) -> None:
        """Before the weight sync: every engine resumes `SYNC_TAGS`."""
        await self._each(clients, "resume", SYNC_TAGS)

    async def resume_cache(self, clients: Sequence[Any]) -> None:
        """After the weight sync: every engine resumes `CACHE_TAGS` (ready to generate)."""
        await self._each(clients, "resume", CACHE_TAGS)

    async def _each(self, clients: Sequence[Any], action: str, tags: tuple[str, ...]) -> None:
        if not self.active or not clients:
            return
        call = (lambda c: c.release(tags)) if action == "release" else (lambda c: c.resume_memory(tags))
        await asyncio.gather(*(call(c) for c in clients))
        self.calls.append((action, tags))
        log.info("rollout engines: %s %s (%d engines)", action, list(tags), len(clients))
