"""Training progress from `run_dir/metrics.jsonl` (streamed) and `run_dir/eval.json`.

Each series keeps at most `MAX_POINTS` points whatever the run length: when full, every other point is dropped
and the sampling stride doubles (the last step is always kept separately); these feed `--plot` and `--json`.
The sparklines come from `trend`: the run's whole step range [first step, last step] split into
`TREND_WIDTH` equal buckets, each drawn as the mean of its values (a second streamed pass over the file;
nulls and NaN skipped). Phase shares are the sums of the `time/*_s` keys over all lines, each divided by
their total. Peak GPU memory (`memory/<child>/<phase>/<kind>`) is the maximum over all lines, per child, phase
and kind.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mopd_hpc.records.metrics_schema import (
    LOSS_KEYS,
    MOPD_KEYS,
    PHASE_KEYS,
    SERIES_KEYS,
    TOKENS_PER_S_KEY,
    MetricsLine,
    MetricsLineError,
    eval_of,
    memory_of,
    route_of,
)
from mopd_hpc.records.run_dir import EVAL_FILE, METRICS_FILE

#: Points kept per series (sparklines and --plot).
MAX_POINTS = 512
SPARK_CHARS = "▁▂▃▄▅▆▇█"
#: Buckets per trend (the sparkline width, in characters).
TREND_WIDTH = 24


class _Series:
    """Down-sampled (step, value) points, bounded to MAX_POINTS."""

    def __init__(self) -> None:
        self.points: list[tuple[int, float]] = []
        self.stride = 1
        self._seen = 0

    def add(self, step: int, value: float) -> None:
        if self._seen % self.stride == 0:
            self.points.append((step, value))
            if len(self.points) >= MAX_POINTS:
                self.points = self.points[::2]
                self.stride *= 2
        self._seen += 1


@dataclass(frozen=True, slots=True)
class Progress:
    """What the metrics say. Empty (`n_lines == 0`) when the run wrote none yet.

    Attributes:
        last_step, last_ts: the last line's step and Unix time.
        first_step: the smallest step of any line (the trend's range is first_step..max step).
        last: every numeric key of the last line.
        routes: route names seen in `reward/<route>` or `accuracy/<route>`.
        phase_share: phase name → fraction of the summed phase seconds (sums to 1 when any time was logged).
        phase_seconds: phase name → total seconds.
        series: key → down-sampled [(step, value)] for SERIES_KEYS, per-route keys and the evaluation points
            (`eval/<stat>/<route>`, on the evaluation steps' lines only).
        trend: key → `TREND_WIDTH` bucket means over the whole step range (module docstring), None for a
            bucket without a finite value; fewer buckets when the range has fewer steps than buckets.
        trend_steps: (first step, last step) the trend buckets cover, or None without lines.
        eval: the parsed eval.json `routes` table, or None.
        bad_lines: lines that broke the contract (skipped).
        memory: child → phase → kind (`allocated_gib`, `reserved_gib`) → the largest value over all lines, GiB;
            {} when no child reported GPU memory (CPU runs).
    """

    n_lines: int
    first_step: int | None
    last_step: int | None
    last_ts: float | None
    last: dict[str, float]
    routes: tuple[str, ...]
    phase_share: dict[str, float]
    phase_seconds: dict[str, float]
    series: dict[str, list[tuple[int, float]]]
    trend: dict[str, list[float | None]]
    trend_steps: tuple[int, int] | None
    eval: dict[str, Any] | None
    bad_lines: int
    memory: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The `progress` object of `mopd-logs summarize --json`; `memory` only when a child reported GPU
        memory (a CPU run's document is unchanged)."""
        out = {
            "n_lines": self.n_lines,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "last_ts": self.last_ts,
            "loss": {k: self.last.get(k) for k in LOSS_KEYS},
            "mopd": {k: self.last.get(k) for k in MOPD_KEYS},
            "tokens_per_s": self.last.get(TOKENS_PER_S_KEY),
            "routes": {
                r: {"reward": self.last.get(f"reward/{r}"), "accuracy": self.last.get(f"accuracy/{r}")}
                for r in self.routes
            },
            "phase_share": self.phase_share,
            "phase_seconds": self.phase_seconds,
            "series": {k: [[s, v] for s, v in pts] for k, pts in self.series.items()},
            "trend": {
                "steps": list(self.trend_steps) if self.trend_steps else None,
                "buckets": max((len(v) for v in self.trend.values()), default=0),
                "means": self.trend,
            },
            "eval": self.eval,
            "bad_lines": self.bad_lines,
        }
        if self.memory:
            out["memory"] = self.memory
        return out


def _lines(path: Path, limit: int | None = None) -> Iterator[MetricsLine | None]:
    """Each non-blank line of `path` parsed (None for one that breaks the contract), at most `limit` lines."""
    if not path.is_file():
        return
    with open(path, encoding="utf-8", errors="replace") as fh:
        seen = 0
        for raw in fh:
            if not raw.strip():
                continue
            if limit is not None and seen >= limit:
                return
            seen += 1
            try:
                yield MetricsLine.from_obj(json.loads(raw))
            except (ValueError, MetricsLineError):
                yield None


def _tracked(key: str) -> bool:
    return key in SERIES_KEYS or route_of(key) is not None or eval_of(key) is not None


def bucket_index(step: int, first: int, last: int, width: int) -> int:
    """The bucket of `step` when steps first..last (inclusive) are split into `min(width, last-first+1)` equal
    buckets: `(step - first) * buckets // (last - first + 1)`, clamped to the valid range."""
    n_steps = last - first + 1
    buckets = max(1, min(width, n_steps))
    return min(buckets - 1, max(0, (step - first) * buckets // n_steps))


def _trend(path: Path, limit: int, first: int, last: int, width: int) -> dict[str, list[float | None]]:
    """Second pass over the first `limit` lines: per tracked key, the mean of each bucket's finite values."""
    buckets = max(1, min(width, last - first + 1))
    sums: dict[str, list[float]] = {}
    counts: dict[str, list[int]] = {}
    for line in _lines(path, limit):
        if line is None or not first <= line.step <= last:
            continue
        b = bucket_index(line.step, first, last, width)
        for key, value in line.values.items():
            if _tracked(key) and math.isfinite(value):
                sums.setdefault(key, [0.0] * buckets)[b] += value
                counts.setdefault(key, [0] * buckets)[b] += 1
    return {k: [total / n if n else None for total, n in zip(sums[k], counts[k], strict=True)] for k in sums}


def read_progress(run_dir: str | os.PathLike[str], trend_width: int = TREND_WIDTH) -> Progress:
    """Stream the metrics file of `run_dir` (missing file → empty Progress); a second streamed pass over the
    same lines builds `trend` (`trend_width` buckets per key over the whole step range)."""
    series: dict[str, _Series] = {}
    phase_s = dict.fromkeys(PHASE_KEYS.values(), 0.0)
    routes: dict[str, None] = {}
    memory: dict[str, dict[str, dict[str, float]]] = {}
    last: MetricsLine | None = None
    first_step = max_step = None
    n = bad = 0
    path = Path(run_dir) / METRICS_FILE
    for line in _lines(path):
        if line is None:
            bad += 1
            continue
        n += 1
        last = line
        first_step = line.step if first_step is None else min(first_step, line.step)
        max_step = line.step if max_step is None else max(max_step, line.step)
        for key, value in line.values.items():
            if key in PHASE_KEYS:
                phase_s[PHASE_KEYS[key]] += value
            fam = route_of(key)
            if fam is not None:
                routes.setdefault(fam[1])
            if _tracked(key):
                series.setdefault(key, _Series()).add(line.step, value)
            mem = memory_of(key)
            if mem is not None and math.isfinite(value):
                kinds = memory.setdefault(mem[0], {}).setdefault(mem[1], {})
                kinds[mem[2]] = max(kinds.get(mem[2], value), value)
    trend: dict[str, list[float | None]] = {}
    trend_steps = None
    if first_step is not None and max_step is not None:
        trend_steps = (first_step, max_step)
        # only the lines the first pass saw (a running job appends meanwhile)
        trend = _trend(path, n + bad, first_step, max_step, trend_width)
    total = sum(phase_s.values())
    return Progress(
        n_lines=n,
        first_step=first_step,
        last_step=last.step if last else None,
        last_ts=last.ts if last else None,
        last=dict(last.values) if last else {},
        routes=tuple(routes),
        phase_share={k: (v / total if total > 0 else 0.0) for k, v in phase_s.items()},
        phase_seconds=phase_s,
        series={k: s.points for k, s in series.items()},
        trend=trend,
        trend_steps=trend_steps,
        eval=_read_eval(Path(run_dir) / EVAL_FILE),
        bad_lines=bad,
        memory=memory,
    )


def _read_eval(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    routes = data.get("routes") if isinstance(data, dict) else None
    return routes if isinstance(routes, dict) else None


def sparkline(values: Sequence[float | None]) -> str:
    """One block character per value, scaled between the finite minimum and maximum (constant input → a
    flat line; None or NaN → a space; no finite value → "")."""
    finite = [v for v in values if v is not None and v == v]
    if not finite:
        return ""
    lo, hi = min(finite), max(finite)
    span = hi - lo
    out = []
    for v in values:
        if v is None or v != v:
            out.append(" ")
        else:
            level = 0 if span == 0 else int((v - lo) / span * (len(SPARK_CHARS) - 1) + 0.5)
            out.append(SPARK_CHARS[level])
    return "".join(out)
