"""The metrics writer: `run_dir/metrics.jsonl`, one JSON line per training step (contract: `metrics_schema`).

    writer = MetricsWriter.open(run_dir / METRICS_FILE, resume_step=ckpt_step)   # rolls back later lines
    writer.write(step, {"loss/total": 0.3, ...})                                  # appended, flushed, fsynced
    writer.close()

Exactly once per step: a resumed run continues from its checkpoint step c, so lines of steps > c (written
after the checkpoint by the run that died) are rolled back first — the file is rewritten atomically
(`mopd_hpc.atomic`) with only the lines of steps ≤ c, the last line of each step kept, and a torn last line
(a writer killed mid-line) dropped. Non-finite floats are written as null (JSON has no NaN).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from mopd_hpc.atomic import atomic_write_text
from mopd_hpc.records.metrics_schema import STEP_KEY, TS_KEY
from mopd_hpc.records.run_dir import METRICS_FILE

__all__ = ["METRICS_FILE", "MetricsWriter", "read_metrics", "rollback_metrics"]


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every parsable line (a JSON object with an int `step`), in file order; [] when the file is absent."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue  # a torn line of a killed writer
        if isinstance(obj, dict) and isinstance(obj.get(STEP_KEY), int):
            out.append(obj)
    return out


def rollback_metrics(path: str | os.PathLike[str], last_step: int) -> int:
    """Rewrite `path` atomically keeping one line per step ≤ `last_step` (the last one of each), in step
    order. Returns the number of lines dropped. A missing file stays missing."""
    target = Path(path)
    if not target.exists():
        return 0
    raw_count = sum(1 for line in target.read_text(encoding="utf-8").splitlines() if line.strip())
    kept: dict[int, dict[str, Any]] = {}
    for obj in read_metrics(target):
        if obj[STEP_KEY] <= last_step:
            kept[obj[STEP_KEY]] = obj
    lines = [json.dumps(kept[s], separators=(",", ":")) for s in sorted(kept)]
    atomic_write_text(target, "".join(line + "\n" for line in lines))
    return raw_count - len(lines)


class MetricsWriter:
    """Appends metrics lines to one file. Build with `MetricsWriter.open(path, resume_step)`."""

    def __init__(self, path: Path, handle: IO[str], fsync: bool) -> None:
        self.path = path
        self._handle: IO[str] | None = handle
        self._fsync = fsync

    @classmethod
    def open(cls, path: str | os.PathLike[str], resume_step: int = 0, *, fsync: bool = True) -> MetricsWriter:
        """Roll back lines after `resume_step` (0 for a fresh run: the file is emptied), then open for append.

        fsync: fsync every line (a line is on disk before the next step starts).
        """
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        rollback_metrics(target, resume_step)
        return cls(target, open(target, "a", encoding="utf-8"), fsync)

    def write(self, step: int, values: Mapping[str, Any], ts: float | None = None) -> dict[str, Any]:
        """Append the line `{"step": step, "ts": ts or now, **values}`; returns it.

        Raises:
            ValueError: step < 0, values set `step`/`ts`, or the writer is closed.
        """
        if self._handle is None:
            raise ValueError(f"metrics writer of {self.path} is closed")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r}: expected an integer >= 0")
        clash = {STEP_KEY, TS_KEY} & set(values)
        if clash:
            raise ValueError(f"values set {sorted(clash)}: the writer sets step and ts itself")
        line = {STEP_KEY: step, TS_KEY: time.time() if ts is None else ts}
        line.update({k: _clean(v) for k, v in values.items()})
        self._handle.write(json.dumps(line, separators=(",", ":")) + "\n")
        self._handle.flush()
        if self._fsync:
            os.fsync(self._handle.fileno())
        return line

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
