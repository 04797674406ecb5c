"""Peak GPU memory of a server child (a teacher, a rollout engine) per phase of the step (issue 21 item 3).

The actor measures its own phases (`trainer/phase_memory.py`); a server does not know the step's phases, but
each of its endpoints runs in one: a teacher's `/score` and `/onload` in `teacher`, its `/offload` in
`drain`; a rollout engine's `/generate` in `rollout`, its weight updates and memory release/resume in `sync`.
`PeakTracker.activity(phase)` brackets one request: at its start the allocator's peak so far is folded into
every phase active then and the peak statistics are reset; at its end the peak since the last reset is folded
into every active phase, this one included. Overlapping requests (concurrent `/generate` calls) each see
every peak of their interval (an overlap of two phases counts for both). Besides the phases, `held` is what
the child holds between its requests: the allocator's current figures when the peaks are read (the
controller reads them at the step's end, `POST /memory_peaks`), which is what a resident teacher keeps through
the train phase. Units GiB (2^30 bytes): `max_memory_allocated` / `max_memory_reserved` (torch's caching
allocator; the CUDA context is not in them). On a CPU device every method is a no-op and `read()` is {}.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

GIB = float(2**30)
#: The phase of what a server holds between its requests (read when the peaks are taken).
HELD = "held"
#: The route a server answers with its peaks since the last read (then forgotten).
PEAKS_PATH = "/memory_peaks"


class PeakTracker:
    """Peaks per phase of this process on `device` (module docstring); inactive unless CUDA."""

    def __init__(self, device: Any) -> None:
        self.device = device if getattr(device, "type", None) == "cuda" else None
        self._active: dict[int, str] = {}
        self._peaks: dict[str, tuple[float, float]] = {}
        self._next = 0

    @property
    def active(self) -> bool:
        return self.device is not None

    def _fold(self, reset: bool) -> None:
        import torch

        allocated = torch.cuda.max_memory_allocated(self.device) / GIB
        reserved = torch.cuda.max_memory_reserved(self.device) / GIB
        for phase in set(self._active.values()):
            before = self._peaks.get(phase, (0.0, 0.0))
            self._peaks[phase] = (max(before[0], allocated), max(before[1], reserved))
        if reset:
            torch.cuda.reset_peak_memory_stats(self.device)

    @contextlib.contextmanager
    def activity(self, phase: str) -> Iterator[None]:
        """Bracket one request of `phase` (no-op when inactive)."""
        if self.device is None:
            yield
            return
        self._fold(reset=True)
        key, self._next = self._next, self._next + 1
        self._active[key] = phase
        try:
            yield
        finally:
            self._fold(reset=False)
            del self._active[key]

    def read(self) -> dict[str, dict[str, float]]:
        """phase → {"allocated_gib", "reserved_gib"} since the last read (then forgotten), with `held` = the
        current figures; {} when inactive."""
        if self.device is None:
            return {}
        import torch

        self._fold(reset=False)
        out = {ph: {"allocated_gib": a, "reserved_gib": r} for ph, (a, r) in self._peaks.items()}
        out[HELD] = {
            "allocated_gib": torch.cuda.memory_allocated(self.device) / GIB,
            "reserved_gib": torch.cuda.memory_reserved(self.device) / GIB,
        }
        self._peaks = {}
        return out


def peak_middleware(tracker: PeakTracker, phases: Mapping[str, str]) -> Callable[..., Any]:
    """An aiohttp middleware that runs each request whose path is in `phases` (path → phase) inside
    `tracker.activity(phase)`."""
    from aiohttp import web

    @web.middleware
    async def track(request: Any, handler: Any) -> Any:
        phase = phases.get(request.path)
        if phase is None:
            return await handler(request)
        with tracker.activity(phase):
            return await handler(request)

    return track


def add_peaks_route(router: Any, tracker: PeakTracker) -> None:
    """`POST /memory_peaks` on an aiohttp router: `tracker.read()` as JSON."""
    from aiohttp import web

    async def peaks(request: Any) -> Any:
        return web.json_response(tracker.read())

    router.add_post(PEAKS_PATH, peaks)


def peak_metrics(child: str, peaks: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """A server's `read()` answer as metrics keys `memory/<child>/<phase>/<kind>` (records/metrics_schema.py)."""
    from mopd_hpc.records.metrics_schema import MEMORY_KINDS, memory_key

    return {
        memory_key(child, phase, kind): float(value)
        for phase, kinds in peaks.items()
        for kind, value in kinds.items()
        if kind in MEMORY_KINDS
    }
