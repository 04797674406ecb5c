"""What a run was let to do unverified: `run_dir/unverified.json`, written by `mopd-submit` (beside
config.yaml) and read by `mopd-logs summarize`.

With `allow_unverified: true` (`mopd-submit --allow-unverified`), each setting whose code is written but has
not run on GPUs here (config/capabilities.py, `config.job_gaps.unverified_gaps`) is a warning instead of a
refusal. The run dir keeps those warnings, so that whoever reads the run later (a failure, odd numbers)
sees what it ran unverified: `{"warnings": [str, ...]}`, one line each as --check printed it, written
atomically; removed when a later submission in the same run dir lets nothing through unverified.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from mopd_hpc.atomic import atomic_write_json
from mopd_hpc.records.run_dir import UNVERIFIED_FILE, PathLike


def write_unverified(run_dir: PathLike, warnings: Sequence[str]) -> Path:
    """Write `warnings` to `run_dir/unverified.json` atomically (remove the file when there are none);
    returns its path. Raises OSError when the run dir is not writable."""
    path = Path(run_dir) / UNVERIFIED_FILE
    if warnings:
        atomic_write_json(path, {"warnings": [str(w) for w in warnings]})
    else:
        path.unlink(missing_ok=True)
    return path


def read_unverified(run_dir: PathLike) -> tuple[str, ...]:
    """The warnings `write_unverified` wrote, in order; () when the file is absent or unreadable (a run
    submitted before it existed, or a damaged file: the summary shows the rest)."""
    try:
        data = json.loads((Path(run_dir) / UNVERIFIED_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ()
    warnings = data.get("warnings") if isinstance(data, dict) else None
    return tuple(w for w in warnings if isinstance(w, str)) if isinstance(warnings, list) else ()
