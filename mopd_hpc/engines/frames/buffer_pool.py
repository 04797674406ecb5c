"""Byte buffers reused between frames (`codec.py`), taken back only when nothing can read them any more.

Why: on some hosts (VMs) the first touch of fresh memory costs more than the copy into it (see
benchmarks/transport.py's host memory rates), and a frame's pieces and bodies are large and frequent.
How it stays safe: a buffer is lent as a memoryview of a fresh numpy view of it; when the last user of that
view lets go (a tensor decoded from a body, an event-loop transport that still holds an unsent piece, any
slice of the memoryview), `weakref.finalize` hands the buffer back. Nothing is reused while referenced.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np
import torch


class BufferPool:
    """Lends writable byte buffers and keeps up to `keep` idle ones (the largest) for reuse. Thread-safe.

    Args:
        keep: the most idle buffers held; 0 keeps none (every `lend` allocates).
    """

    def __init__(self, keep: int = 2) -> None:
        if keep < 0:
            raise ValueError(f"keep={keep}: expected >= 0 idle buffers")
        self.keep = keep
        self._idle: list[np.ndarray] = []
        self._lock = threading.Lock()

    def lend(self, nbytes: int) -> memoryview:
        """A writable byte memoryview of exactly `nbytes` (its contents are garbage: write before reading).
        Its buffer comes back to the pool once the memoryview and everything made from it are gone."""
        base = None
        with self._lock:
            fits = [k for k, a in enumerate(self._idle) if a.nbytes >= nbytes]
            if fits:
                base = self._idle.pop(min(fits, key=lambda k: self._idle[k].nbytes))
        if base is None:
            base = torch.empty(max(nbytes, 1), dtype=torch.uint8).numpy()  # not zero-filled
        view = base[:nbytes]  # a new array object: its death (not base's) returns the buffer
        weakref.finalize(view, self._give_back, base)
        return memoryview(view)

    def _give_back(self, base: np.ndarray) -> None:
        with self._lock:
            self._idle = sorted([*self._idle, base], key=lambda a: -a.nbytes)[: self.keep]

    @property
    def idle_bytes(self) -> int:
        """Bytes held by idle buffers."""
        with self._lock:
            return sum(a.nbytes for a in self._idle)
