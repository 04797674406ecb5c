"""Turn pytest's `--durations` report into tests/durations.json, the table the parallel pass orders its work by.

    python tools/test_durations.py LOG [LOG ...] [--out tests/durations.json] [--min-s 2]

LOG is the output of a run with `--durations=0` (e.g. `make test PYTEST_ARGS="--durations=0 --durations-min=1.0"`):
lines such as `12.34s call     tests/e2e/test_resume.py::test_x`. A test's seconds are its setup + call +
teardown summed (a module-scoped fixture's set-up counts in the first test that asks for it); the xdist group
suffix (`@group`) is dropped, so a nodeid reads as `pytest --collect-only` prints it. Tests under `--min-s`
seconds are left out (the table only has to tell the long ones apart). A nodeid in several logs keeps its largest
sum. Written sorted longest first, seconds rounded to 0.1. Exit status: 0, or 2 when no duration line was read.

tests/conftest.py reads the table at collection; an entry whose test no longer exists is ignored, a test with no
entry counts as short. Seconds measured under load (4 workers on 2 cores) are fine: only the order matters.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from mopd_hpc.atomic import atomic_write_text

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "tests" / "durations.json"
DEFAULT_MIN_S = 2.0
#: One line of pytest's durations report: seconds, phase, nodeid.
LINE = re.compile(r"^\s*(?P<s>\d+(?:\.\d+)?)s (?P<phase>setup|call|teardown)\s+(?P<nodeid>\S.*?)\s*$")


def strip_group(nodeid: str) -> str:
    """`tests/a.py::t@tests/a.py` → `tests/a.py::t` (xdist's loadgroup suffix; an `@` inside `[...]` stays)."""
    at = nodeid.rfind("@")
    return nodeid[:at] if at > nodeid.rfind("]") else nodeid


def sum_durations(lines: Iterable[str]) -> dict[str, float]:
    """nodeid → setup + call + teardown seconds, from the report lines among `lines` (others are skipped)."""
    totals: dict[str, float] = {}
    for line in lines:
        match = LINE.match(line)
        if match:
            nodeid = strip_group(match["nodeid"])
            totals[nodeid] = totals.get(nodeid, 0.0) + float(match["s"])
    return totals


def table(logs: Sequence[str], min_s: float) -> dict[str, float]:
    """The durations table of several logs' text: per nodeid the largest sum, those ≥ `min_s`, longest first."""
    merged: dict[str, float] = {}
    for text in logs:
        for nodeid, seconds in sum_durations(text.splitlines()).items():
            merged[nodeid] = max(merged.get(nodeid, 0.0), seconds)
    kept = [(nodeid, round(s, 1)) for nodeid, s in merged.items() if s >= min_s]
    return dict(sorted(kept, key=lambda kv: (-kv[1], kv[0])))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tools/test_durations.py", description=__doc__.split("\n")[0]
    )
    parser.add_argument("logs", nargs="+", type=Path, help="pytest output with a --durations report")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the table to write (JSON)")
    parser.add_argument("--min-s", type=float, default=DEFAULT_MIN_S, help="leave out tests under this")
    args = parser.parse_args(argv)
    durations = table([p.read_text(errors="replace") for p in args.logs], args.min_s)
    if not durations:
        print(
            f"no duration line of at least {args.min_s} s in {[str(p) for p in args.logs]}", file=sys.stderr
        )
        return 2
    atomic_write_text(args.out, json.dumps(durations, indent=1) + "\n")
    print(f"{len(durations)} tests, {sum(durations.values()):.0f} s in all, written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
