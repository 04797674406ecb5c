"""Reading and printing `run_dir/eval.json`, the run's evaluation record (written by `trainer/evaluate.py`, whose
docstring gives its fields): json and text only, so that `mopd-submit` prints a finished run's table without
importing torch (the evaluation itself lives in trainer/)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from mopd_hpc.records.run_dir import EVAL_FILE


def read_eval(run_dir: Path) -> dict[str, Any] | None:
    """run_dir/eval.json, or None when absent or unreadable."""
    try:
        return json.loads((run_dir / EVAL_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def format_eval_table(record: Mapping[str, Any]) -> str:
    """A plain-text table: route, n, teacher, student start, student end, end as % of teacher."""
    head = f"{'route':<14} {'n':>5} {'teacher':>8} {'start':>8} {'end':>8} {'end/teacher':>12}"
    lines = [head, "-" * len(head)]
    for route, r in record.get("routes", {}).items():
        teacher, end = r.get("teacher"), r.get("student_end")
        ratio = "-" if not teacher or end is None else f"{100 * end / teacher:.1f}%"
        lines.append(
            f"{route:<14} {r.get('n', 0):>5} {_pct(teacher):>8} {_pct(r.get('student_start')):>8} "
            f"{_pct(end):>8} {ratio:>12}"
        )
    return "\n".join(lines)


def print_eval_table(run_dir: Path, out: TextIO) -> bool:
    """Print the run's evaluation table (when eval.json exists); returns whether it printed."""
    record = read_eval(run_dir)
    if record is None:
        return False
    print(f"evaluation ({run_dir / EVAL_FILE}):", file=out)
    print(format_eval_table(record), file=out, flush=True)
    return True
