"""Training progress from `run_dir/metrics.jsonl` (streamed) and `run_dir/eval.json`.

Each series keeps at most `MAX_POINTS` points whatever the run length: when full, every other point is dropped
and the sampling stride doubles (the last step is always kept separately). Phase shares are the sums of the
`time/*_s` keys over all lines, each divided by their total.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mopd_hpc.logs.metrics_schema import (
    EVAL_FILE,
    LOSS_KEYS,
    METRICS_FILE,
    MOPD_KEYS,
    PHASE_KEYS,
    SERIES_KEYS,
    TOKENS_PER_S_KEY,
    MetricsLine,
    MetricsLineError,
    route_of,
)

#: Points kept per series (sparklines and --plot).
MAX_POINTS = 512
SPARK_CHARS = "▁▂▃▄▅▆▇█"


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
        last: every numeric key of the last line.
        routes: route names seen in `reward/<route>` or `accuracy/<route>`.
        phase_share: phase name → fraction of the summed phase seconds (sums to 1 when any time was logged).
        phase_seconds: phase name → total seconds.
        series: key → down-sampled [(step, value)] for SERIES_KEYS and per-route keys.
        eval: the parsed eval.json `routes` table, or None.
        bad_lines: lines that broke the contract (skipped).
    """

    n_lines: int
    last_step: int | None
    last_ts: float | None
    last: dict[str, float]
    routes: tuple[str, ...]
    phase_share: dict[str, float]
    phase_seconds: dict[str, float]
    series: dict[str, list[tuple[int, float]]]
    eval: dict[str, Any] | None
    bad_lines: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "n_lines": self.n_lines,
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
            "eval": self.eval,
            "bad_lines": self.bad_lines,
        }


def read_progress(run_dir: str | os.PathLike[str]) -> Progress:
    """Stream the metrics file of `run_dir` (missing file → empty Progress)."""
    series: dict[str, _Series] = {}
    phase_s = dict.fromkeys(PHASE_KEYS.values(), 0.0)
    routes: dict[str, None] = {}
    last: MetricsLine | None = None
    n = bad = 0
    path = Path(run_dir) / METRICS_FILE
    if path.is_file():
        with open(path, encoding="utf-8", errors="replace") as fh:
            for raw in fh:
                if not raw.strip():
                    continue
                try:
                    line = MetricsLine.from_obj(json.loads(raw))
                except (ValueError, MetricsLineError):
                    bad += 1
                    continue
                n += 1
                last = line
                for key, value in line.values.items():
                    if key in PHASE_KEYS:
                        phase_s[PHASE_KEYS[key]] += value
                    fam = route_of(key)
                    if fam is not None:
                        routes.setdefault(fam[1])
                    if key in SERIES_KEYS or fam is not None:
                        series.setdefault(key, _Series()).add(line.step, value)
    total = sum(phase_s.values())
    return Progress(
        n_lines=n,
        last_step=last.step if last else None,
        last_ts=last.ts if last else None,
        last=dict(last.values) if last else {},
        routes=tuple(routes),
        phase_share={k: (v / total if total > 0 else 0.0) for k, v in phase_s.items()},
        phase_seconds=phase_s,
        series={k: s.points for k, s in series.items()},
        eval=_read_eval(Path(run_dir) / EVAL_FILE),
        bad_lines=bad,
    )


def _read_eval(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    routes = data.get("routes") if isinstance(data, dict) else None
    return routes if isinstance(routes, dict) else None


def sparkline(values: list[float], width: int = 24) -> str:
    """`values` as block characters (the last `width` points; constant input → a flat line; NaN → space)."""
    vals = values[-width:]
    finite = [v for v in vals if v == v]
    if not finite:
        return ""
    lo, hi = min(finite), max(finite)
    span = hi - lo
    out = []
    for v in vals:
        if v != v:
            out.append(" ")
        else:
            level = 0 if span == 0 else int((v - lo) / span * (len(SPARK_CHARS) - 1) + 0.5)
            out.append(SPARK_CHARS[level])
    return "".join(out)
