"""Seconds of the consecutive spans of one call, as device time: on CUDA every boundary waits for the device's
queued work first (`torch.cuda.synchronize(device)`), so a span holds the kernels it launched, not only the
time the host took to queue them; on any other device (CPU) no synchronization (the work is already done).

The train step's spans (`time/train/forward_backward_s`, `time/train/optimizer_s`, `records/metrics_schema.py`)
and the TRAIN phase's prepare span (`trainer/rank_step.py`) are measured with it.
"""

from __future__ import annotations

import time

import torch


def device_sync(device: torch.device | str | None) -> None:
    """Wait for the work queued on `device` when it is a CUDA device; a no-op for CPU, other devices, or None."""
    if device is None:
        return
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SpanClock:
    """Consecutive spans of a call: `start` once, then `lap(name)` at the end of each span.

    Args:
        device: where the measured work runs (CUDA: each boundary synchronizes it; CPU or None: it does not).

    Attributes:
        spans: name → seconds (float, >= 0) of each lap, in lap order (a name lapped twice adds up).
    """

    def __init__(self, device: torch.device | str | None) -> None:
        self.device = device
        self.spans: dict[str, float] = {}
        self._t: float | None = None

    def start(self) -> None:
        """Begin the first span (after the device's queued work: that belongs to what came before)."""
        device_sync(self.device)
        self._t = time.perf_counter()

    def lap(self, name: str) -> float:
        """End the running span as `name` and begin the next; returns its seconds.

        `start` must have been called (asserted: a bug of the caller otherwise).
        """
        assert self._t is not None, "SpanClock.lap before SpanClock.start"
        device_sync(self.device)
        now = time.perf_counter()
        seconds = now - self._t
        self.spans[name] = self.spans.get(name, 0.0) + seconds
        self._t = now
        return seconds

    def skip(self) -> None:
        """Begin the next span now, dropping the time since the last boundary (work no span is named for)."""
        self.start()
