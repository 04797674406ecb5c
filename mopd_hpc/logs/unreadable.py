"""What the summarizer could not read: unreadable lines of the run's JSONL files and unreadable JSON records.

Every reader of `mopd-logs summarize` skips what it cannot parse (a half-written last line of a job that was
killed mid-write, garbage, a record cut to zero bytes by a full disk) and goes on; this module names what
was skipped, so that a gap in a curve or a missing fact has a stated cause:

    metrics.jsonl: 4 unreadable lines (first: line 61, half-written)
    events/n1.guard.jsonl: 1 unreadable line (first: line 9, binary bytes)
    state/job.json: unreadable (empty)

Files checked (`unreadable_files`): `metrics.jsonl` (each line a JSON object that keeps the metrics contract,
`records/metrics_schema.MetricsLine`), `events/*.jsonl` (each line a JSON object), and the JSON records
`state/*.json`, `guards/*.json`, `eval.json` (one object each). A missing file is not unreadable.

Reasons, first match wins: `binary bytes` (a NUL byte, or bytes that are not UTF-8), `half-written` (the text
ends inside the JSON value, or inside a string of it: the writer stopped mid-line), `empty` (a record of zero bytes), `nested too deep` (past the JSON decoder's depth), `not JSON`,
`not a JSON object`, `not a metrics line: <why>`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mopd_hpc.records.metrics_schema import MetricsLine, MetricsLineError
from mopd_hpc.records.run_dir import EVAL_FILE, EVENTS_DIR, GUARDS_DIR, METRICS_FILE, STATE_DIR

#: Longest reason kept from a contract error.
_REASON_CHARS = 80


@dataclass(frozen=True, slots=True)
class Unreadable:
    """One file with something the summarizer skipped.

    Attributes:
        file: the path relative to the run dir, e.g. `metrics.jsonl`.
        lines: unreadable lines of a JSONL file; None for a JSON record (the whole file is unreadable).
        first_line: the 1-based number of the first unreadable line (None for a record).
        reason: why the first one is unreadable (module docstring).
    """

    file: str
    lines: int | None
    first_line: int | None
    reason: str

    def describe(self) -> str:
        """One line, e.g. `metrics.jsonl: 4 unreadable lines (first: line 61, half-written)`."""
        if self.lines is None:
            return f"{self.file}: unreadable ({self.reason})"
        plural = "line" if self.lines == 1 else "lines"
        return f"{self.file}: {self.lines} unreadable {plural} (first: line {self.first_line}, {self.reason})"

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "lines": self.lines, "first_line": self.first_line, "reason": self.reason}


def parse_problem(raw: bytes) -> tuple[Any, str | None]:
    """(the parsed JSON, None) or (None, why `raw` is not readable JSON: module docstring's reasons)."""
    if b"\0" in raw:
        return None, "binary bytes"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "binary bytes"
    stripped = text.strip()
    if not stripped:
        return None, "empty"
    try:
        return json.loads(stripped), None
    except json.JSONDecodeError as exc:
        cut = exc.pos >= len(stripped) or exc.msg.startswith("Unterminated string")
        return None, "half-written" if cut else "not JSON"
    except RecursionError:  # nested past the decoder's depth
        return None, "nested too deep"


def _metrics_problem(obj: Any) -> str | None:
    try:
        MetricsLine.from_obj(obj)
    except (MetricsLineError, ValueError, TypeError) as exc:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return f"not a metrics line: {why[:_REASON_CHARS]}"
    return None


def _object_problem(obj: Any) -> str | None:
    return None if isinstance(obj, dict) else "not a JSON object"


def scan_jsonl(
    path: Path, name: str, check: Callable[[Any], str | None] = _object_problem
) -> Unreadable | None:
    """The unreadable lines of the JSONL file `path` (blank lines skipped; `check` says why a parsed line is
    unreadable, or None), reported as `name`; None when every line reads or the file is missing."""
    count, first, reason = 0, None, ""
    try:
        with open(path, "rb") as fh:
            for number, raw in enumerate(fh, start=1):
                if not raw.strip():
                    continue
                obj, why = parse_problem(raw)
                if why is None:
                    why = check(obj)
                if why is not None:
                    count += 1
                    if first is None:
                        first, reason = number, why
    except OSError:
        return None
    return None if first is None else Unreadable(name, count, first, reason)


def scan_record(path: Path, name: str) -> Unreadable | None:
    """`path` as one JSON object: None when it reads (or is missing), else why not, reported as `name`."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    obj, why = parse_problem(raw)
    why = why if why is not None else _object_problem(obj)
    return None if why is None else Unreadable(name, None, None, why)


def _records(root: Path) -> Iterator[Path]:
    for folder in (STATE_DIR, GUARDS_DIR):
        yield from sorted((root / folder).glob("*.json"))
    yield root / EVAL_FILE


def unreadable_files(root: Path) -> tuple[Unreadable, ...]:
    """Every file of the run dir `root` the summarizer could not read whole (module docstring), in the order
    metrics, events, records."""
    found = [scan_jsonl(root / METRICS_FILE, METRICS_FILE, _metrics_problem)]
    found += [
        scan_jsonl(p, p.relative_to(root).as_posix()) for p in sorted((root / EVENTS_DIR).glob("*.jsonl"))
    ]
    found += [scan_record(p, p.relative_to(root).as_posix()) for p in _records(root)]
    return tuple(u for u in found if u is not None)
