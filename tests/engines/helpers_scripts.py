"""Tests that must run code in a fresh interpreter (it patches modules or the garbage collector process-wide):
`run_report` runs a script and returns the JSON report its last stdout line holds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def run_report(tmp_path: Path, source: str, timeout_s: float, name: str = "script.py") -> dict[str, Any]:
    """Write `source` to tmp_path/name, run it with this interpreter (cwd: the repository) and return the
    JSON object of its last stdout line; an exit code other than 0 fails with the tail of its stderr."""
    script = tmp_path / name
    script.write_text(source)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=timeout_s, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
