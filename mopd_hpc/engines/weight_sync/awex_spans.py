"""Where an AWEX colocate sync spends its time: seconds per sub-phase of one publish / one update (issue 22).

awex 0.9.0's colocate choreography per sync (writer = the actor, `awex/writer/{weights,nccl}_writer.py`;
reader = the rollout server, `awex/reader/{weights,nccl}_reader.py`), and the span each part is timed in:

    writer  actor_offload_optimizer   optimizer state → pinned host (`_release_memory_for_weights_exchange`)
            actor_onload_weights / actor_offload_weights   the DDP weight buffers, host ↔ device
            convert                   mcore → HF tensors (`convert_parameters`)
            group_copy                the HF tensors concatenated into new grouped buffers (a full copy)
            serialize                 ForkingPickler of the CUDA IPC handles (`cuda_ipc_serialize`)
            meta_wait                 blocked in MetaServer get_object (the reader's "update finished")
            wait_readers              `_finish_weights_update` (polls the MetaServer, then a barrier)
    reader  engine_offload / engine_onload   the HF engine's weights, module.to(cpu) / .to(device)
            reader_update             the reader's whole update (includes the two above)

Spans may nest (writer_release contains actor_offload_optimizer; reader_update contains engine_*); the
rest of a publish (gc.collect, MetaServer polls between spans, empty_cache) is publish minus the top-level
spans. The cost is one perf_counter pair per timed call (a few dozen per sync).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any


class Spans:
    """Seconds per span name, accumulated until `take()` (thread-safe: awex calls from worker threads)."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self._seconds[name] = self._seconds.get(name, 0.0) + seconds

    def take(self) -> dict[str, float]:
        """The accumulated spans, then start again from none."""
        with self._lock:
            out, self._seconds = self._seconds, {}
        return out

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn`, its wall time added to span `name` on every call (also when it raises)."""

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - t0)

        wrapper.__mopd_spans__ = self  # type: ignore[attr-defined]
        return wrapper


def time_attribute(owner: Any, attr: str, spans: Spans, name: str) -> None:
    """Replace `owner.attr` (a method of an object, or a function of a module) by its timed wrapper; a
    missing attribute is left alone (another awex version), an already timed one is re-pointed at `spans`."""
    fn = getattr(owner, attr, None)
    if fn is None:
        return
    fn = getattr(fn, "__wrapped__", fn) if hasattr(fn, "__mopd_spans__") else fn
    setattr(owner, attr, spans.timed(name, fn))


def time_colocate_writer(writer: Any, spans: Spans) -> None:
    """Time an awex NCCLWeightsWriter's colocate sub-phases (module docstring) into `spans`."""
    import awex.writer.nccl_writer as nccl_writer

    for attr, name in (
        ("convert_parameters", "convert"),
        ("_release_memory_for_weights_exchange", "writer_release"),
        ("_finish_weights_update", "wait_readers"),
    ):
        time_attribute(writer, attr, spans, name)
    for attr, name in (
        ("group_tensors_by_shape_and_dtype", "group_copy"),
        ("cuda_ipc_serialize", "serialize"),
    ):
        time_attribute(nccl_writer, attr, spans, name)
    client = getattr(writer, "meta_server_client", None)
    if client is not None:
        time_attribute(client, "get_object", spans, "meta_wait")
