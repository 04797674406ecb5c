"""awex 0.9.0's per-sync fixed latencies, removed by targeted idempotent patches.

Each patch keeps awex's semantics (the same results, timeouts and error messages) and may be applied any
number of times; the writer (awex_actor.py) and the HF reader (awex_hf.py) apply gaps 8–10 before building
awex's objects and call gap 11's after each sync (it acts once, after the first). Gaps 1–7 (correctness)
are listed in awex.py. Tests: tests/engines/test_awex_config.py (gap 8), tests/engines/test_awex_latency.py (gaps 9–11).

8. latency: every AWEX handshake is a key or a set on the MetaServer (HTTP) that the other side polls for
   (`MetaServerClient.wait_key`, `.wait_set_until_size`) with a back-off from 0.2 s growing ×1.5 to 1 s (3 s
   after a minute); a set wait sleeps twice per round. A colocate sync waits on five of them in sequence, so
   on the H200 a one-rank sync of a 0.6B model took ~1.8 s of which ~1.6 s were spent after the data had
   been copied. `fast_meta_server_polling()` replaces the two waits with the same semantics (the same
   timeouts and TimeoutError messages) polling from `POLL_INITIAL_S` growing ×1.5 to `POLL_MAX_S`
   (benchmarks/awex_meta_polling.py).
9. latency, separate mode: a steady-state sync has no MetaServer round trip and no sleep, but each side ends
   its step with a full `gc.collect()` (awex/writer/nccl_writer.py:298, awex/reader/nccl_reader.py:405) to
   release the step's converted tensors. In a process holding torch + transformers + megatron.core + awex
   (~0.5 M tracked objects) one full collection takes ~0.2 s (benchmarks/awex_step_overhead.py: over 95 %
   of awex's per-step CPU time on each side). The writer's falls inside `publish`; the reader's falls after
   the final barrier and delays the engine's return. The tensors are freed by refcount when awex clears its
   dicts in the same `finally`; the collection only catches cycles, and a step's own objects are young.
   `young_gc_in_separate_steps()` makes `gc.collect()` collect generations ≤ `YOUNG_GC_GENERATION` while
   (and only while) the writer's `_write_weights` or the reader's `_update_weights` runs in this thread;
   colocate mode's collections (which must close CUDA IPC handles before signalling) stay full.
   Measured on 2 H200s (benchmarks/weight_sync.py, bf16, median of 3; NCCL bandwidth 362 GB/s in the same
   run), with gaps 9–11: a separate sync (the writer's `publish`) went from 0.359 to 0.028 s at 0.6B
   (1.19 GB) and from 0.378 to 0.037 s at 1.7B (3.44 GB); in the job (tests/e2e/test_gpu_job.py, steps 2–3)
   from 0.33–0.45 to 0.024–0.025 s.
10. latency: `awex.util.device.get_device_type()` (called by every awex synchronize/current_device) retries
   `import torch_npu` on each call, a failing import that searches all of sys.path (~40 µs on a local
   disk, more on a shared file system). `cached_device_probe()` probes the NPU once per process; the
   AWEX_DEVICE_TYPE override is still read on every call.
11. latency, colocate mode: its steps keep full collections (awex/writer/nccl_writer.py:410,
   awex/reader/nccl_reader.py:472 and :493; the reader's must close CUDA IPC handles before it signals the
   writer), ~0.2 s each over the ~0.5 M objects the process holds after start-up.
   `freeze_long_lived_objects()` runs once per process after the first sync (publish or update): one full
   collection, then `gc.freeze()`, which moves every object alive then (modules, models, awex's plans and
   buffers: what lives for the whole run) out of the collector's reach. Later full collections traverse only
   what was created after it, so they still find every step's garbage (IPC handles included), at a fraction
   of the cost. The price: a frozen object that later becomes part of an unreachable cycle is not reclaimed
   (CPython's documented trade-off of gc.freeze, meant for long-lived start-up objects). Measured on 2 H200s
   (the same run as gap 9's): a colocate sync went from 1.29 to 0.51 s at 0.6B and from 1.68 to 1.00 s at
   1.7B; in the job (tests/e2e/test_gpu_job.py, steps 2–3) from 1.47–1.63 to 0.84–0.97 s.
"""

from __future__ import annotations

import gc
import importlib
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from mopd_hpc.engines.weight_sync.awex import require_awex

# ------------------------------------------------------------------------------ gap 8: MetaServer polling

#: Polling of MetaServer keys and sets (gap 8): first interval and cap, in seconds.
POLL_INITIAL_S = 0.002
POLL_MAX_S = 0.05


def _wait_key(self: Any, key: str, timeout: float) -> None:
    """`MetaServerClient.wait_key` polling at POLL_INITIAL_S… POLL_MAX_S (gap 8)."""
    deadline = time.monotonic() + timeout
    delay = POLL_INITIAL_S
    while not self._has_key(key):
        if time.monotonic() >= deadline:
            raise TimeoutError(f"Timeout waiting for key '{key}'")
        time.sleep(delay)
        delay = min(delay * 1.5, POLL_MAX_S)


def _wait_set_until_size(
    self: Any, key: str, size: int, timeout: float, delete_after_wait: bool = False
) -> None:
    """`MetaServerClient.wait_set_until_size` polling at POLL_INITIAL_S… POLL_MAX_S (gap 8)."""
    deadline = time.monotonic() + timeout
    delay = POLL_INITIAL_S
    while True:
        current = self.get_object(key, default_value=set())
        if current is not None and len(current) >= size:
            break
        if time.monotonic() >= deadline:
            raise TimeoutError(f"Timeout waiting for set {key} to reach size {size}")
        time.sleep(delay)
        delay = min(delay * 1.5, POLL_MAX_S)
    if delete_after_wait:
        self.delete_if_exists(key)


def fast_meta_server_polling() -> None:
    """Gap 8 (module docstring): awex's MetaServer clients poll keys and sets from POLL_INITIAL_S up to
    POLL_MAX_S instead of 0.2 s up to 1 s. Idempotent.

    Raises:
        AwexUnavailableError: awex or megatron.core is not importable.
    """
    require_awex()
    from awex.meta.meta_server import MetaServerClient

    MetaServerClient.wait_key = _wait_key
    MetaServerClient.wait_set_until_size = _wait_set_until_size


# --------------------------------------------------------------- gap 9: young collections in separate steps

#: Oldest generation `gc.collect()` reaches inside a separate-mode sync step (gap 9): 0 and 1, where a step's
#: own objects are.
YOUNG_GC_GENERATION = 1
#: awex modules whose `gc` name is replaced by `STEP_GC` (gap 9).
_GC_HOLDERS = ("awex.writer.nccl_writer", "awex.reader.nccl_reader")


class StepScopedGC:
    """Stands in for the `gc` module in awex's NCCL writer and reader modules (gap 9): `collect(generation)`
    collects at most YOUNG_GC_GENERATION while a separate-mode step runs in the calling thread (`step()`),
    and is `gc.collect` everywhere else. Every other attribute is gc's."""

    def __init__(self) -> None:
        self._local = threading.local()

    def __getattr__(self, name: str) -> Any:
        return getattr(gc, name)

    @property
    def in_step(self) -> bool:
        """Whether the calling thread is inside a separate-mode step."""
        return getattr(self._local, "depth", 0) > 0

    def collect(self, generation: int = 2) -> int:
        """`gc.collect(generation)`, capped at YOUNG_GC_GENERATION inside a step. Returns gc's count."""
        return gc.collect(min(generation, YOUNG_GC_GENERATION) if self.in_step else generation)

    @contextmanager
    def step(self) -> Iterator[None]:
        """Scope of one separate-mode step in this thread (re-entrant; left also on an exception)."""
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1


STEP_GC = StepScopedGC()


def _young_gc_step(original: Callable[..., Any]) -> Callable[..., Any]:
    if getattr(original, "_mopd_young_gc", False):
        return original

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        with STEP_GC.step():
            return original(self, *args, **kwargs)

    step._mopd_young_gc = True  # type: ignore[attr-defined]
    step.__wrapped__ = original  # type: ignore[attr-defined]
    step.__name__ = getattr(original, "__name__", "step")
    return step


def young_gc_in_separate_steps() -> None:
    """Gap 9 (module docstring): the full `gc.collect()` that ends each separate-mode sync step on both sides
    collects the young generations only (<= YOUNG_GC_GENERATION); colocate mode is unchanged. Idempotent.

    Raises:
        AwexUnavailableError: awex or megatron.core is not importable.
    """
    require_awex()
    for name in _GC_HOLDERS:
        importlib.import_module(name).gc = STEP_GC
    from awex.reader.nccl_reader import NCCLWorkerWeightsReader
    from awex.writer.nccl_writer import NCCLWeightsWriter

    NCCLWeightsWriter._write_weights = _young_gc_step(NCCLWeightsWriter.__dict__["_write_weights"])
    NCCLWorkerWeightsReader._update_weights = _young_gc_step(
        NCCLWorkerWeightsReader.__dict__["_update_weights"]
    )


# ------------------------------------------------------------------------------ gap 10: NPU probe once


def _probe_once(original: Callable[[], bool]) -> Callable[[], bool]:
    if getattr(original, "_mopd_probe_once", False):
        return original
    seen: list[bool] = []

    def is_npu_available() -> bool:
        if not seen:
            seen.append(bool(original()))
        return seen[0]

    is_npu_available._mopd_probe_once = True  # type: ignore[attr-defined]
    is_npu_available.__wrapped__ = original  # type: ignore[attr-defined]
    return is_npu_available


def cached_device_probe() -> None:
    """Gap 10 (module docstring): awex's NPU probe (`import torch_npu`, retried by every
    `get_device_type()` call) runs once per process. Idempotent.

    Raises:
        AwexUnavailableError: awex or megatron.core is not importable.
    """
    require_awex()
    module = importlib.import_module("awex.util.device")
    module.is_npu_available = _probe_once(module.is_npu_available)


# ----------------------------------------------------------------- gap 11: freeze the long-lived objects

_FROZEN: list[bool] = []


def freeze_long_lived_objects() -> bool:
    """Gap 11 (module docstring): the first call in a process runs a full `gc.collect()` then `gc.freeze()`;
    later calls do nothing. Returns whether this call froze (True once per process)."""
    if _FROZEN:
        return False
    _FROZEN.append(True)
    gc.collect()
    gc.freeze()
    return True
