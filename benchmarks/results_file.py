"""The end of every benchmark script: its result, as JSON, written atomically under benchmarks/results/."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from mopd_hpc.atomic import atomic_write_json


def write_results(out: Path, result: dict[str, Any]) -> int:
    """Write `result` to `out` (parents made; atomic: a crash leaves the previous file), say so, return 0."""
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, result)
    print(f"wrote {out}")
    return 0


def commit_of(given: str | None = None) -> str:
    """`given` when set (a copy of the tree without .git, e.g. on the device machine), else git rev-parse HEAD
    of this checkout, else "unknown"."""
    if given:
        return given
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parents[1],
                             capture_output=True, text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"
