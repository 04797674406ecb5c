"""The end of every benchmark script: its result, as JSON, written atomically under benchmarks/results/."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mopd_hpc.atomic import atomic_write_json


def write_results(out: Path, result: dict[str, Any]) -> int:
    """Write `result` to `out` (parents made; atomic: a crash leaves the previous file), say so, return 0."""
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, result)
    print(f"wrote {out}")
    return 0
