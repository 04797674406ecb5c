"""Control-plane request records of the rollout HTTP surface: memory tags, and the routes of memory and
weight-update endpoints (the weight-update records are `engines/weight_sync/requests.py`'s).

Shapes: SGLang 0.5.23 `io_struct.py` (notes: ../shared/reference/algo_awex.md §3.2). Built by `from_json`,
which validates; a bad field raises `RolloutRequestError` (HTTP 400). No torch, no aiohttp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mopd_hpc.engines.request_fields import fail, json_object, reject_unknown

#: Memory tags of /release_memory_occupation and /resume_memory_occupation (SGLang `GPU_MEMORY_TYPE_*`).
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
#: Modes of /pause_generation: "abort" ends running and queued requests (finish_reason abort);
#: "in_place" and "retract" keep them and continue on /continue_generation.
PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass(frozen=True, slots=True)
class MemoryTagsRequest:
    """Body of /release_memory_occupation and /resume_memory_occupation: `tags` null or empty = all."""

    tags: tuple[str, ...]

    @classmethod
    def from_json(cls, body: Any) -> MemoryTagsRequest:
        body = json_object("body", body)
        reject_unknown("memory occupation body", body, ("tags",))
        tags = body.get("tags") or list(MEMORY_TAGS)
        if not isinstance(tags, list):
            raise fail("tags", tags, f"a list of tags from {list(MEMORY_TAGS)}")
        for tag in tags:
            if tag not in MEMORY_TAGS:
                raise fail("tags[]", tag, f"one of {list(MEMORY_TAGS)}")
        return cls(tags=tuple(dict.fromkeys(tags)))


def add_memory_routes(router: Any, release: Any, resume: Any, flush: Any) -> None:
    """Register SGLang's memory endpoints on an aiohttp router, for GET and POST as SGLang accepts them:
    /release_memory_occupation, /resume_memory_occupation, /flush_cache (handlers given in that order)."""
    for path, handler in (
        ("/release_memory_occupation", release),
        ("/resume_memory_occupation", resume),
        ("/flush_cache", flush),
    ):
        router.add_get(path, handler)
        router.add_post(path, handler)


def add_weight_routes(router: Any, init_group: Any, update: Any, destroy_group: Any, from_disk: Any) -> None:
    """Register SGLang's weight-update endpoints (POST) on an aiohttp router, handlers in this order:
    /init_weights_update_group, /update_weights_from_distributed, /destroy_weights_update_group,
    /update_weights_from_disk."""
    for path, handler in (
        ("/init_weights_update_group", init_group),
        ("/update_weights_from_distributed", update),
        ("/destroy_weights_update_group", destroy_group),
        ("/update_weights_from_disk", from_disk),
    ):
        router.add_post(path, handler)
