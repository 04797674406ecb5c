"""Tracebacks compared across ranks: `normalize_line` (numbers, addresses, times, IPs replaced),
`traceback_signature` of a scanned log, and `child_label`, the name a child is reported by ("same on N other
ranks" in `failure.find_first_failure`)."""

from __future__ import annotations

import re

from mopd_hpc.logs.run_events import ChildRun
from mopd_hpc.logs.scan import ScanResult

_NORMALIZERS = (
    (re.compile(r"0x[0-9a-fA-F]+"), "0xADDR"),
    (re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?Z?"), "TIME"),
    (re.compile(r"\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?"), "ADDR"),
    (re.compile(r"\d+"), "N"),
)


def normalize_line(line: str) -> str:
    """`line` with addresses, times, IPs and every number replaced, to compare tracebacks across ranks."""
    for pattern, repl in _NORMALIZERS:
        line = pattern.sub(repl, line)
    return line.strip()


def traceback_signature(scan: ScanResult | None) -> tuple[str, ...] | None:
    """The normalized fatal (last) traceback of a scanned log, or None without one."""
    if scan is None or scan.last_traceback is None:
        return None
    return tuple(normalize_line(x) for x in scan.last_traceback.lines)


def child_label(child: ChildRun) -> str:
    """`n2 actor-1` (`n2 actor-1.g2` for a restarted generation)."""
    gen = f".g{child.generation}" if child.generation > 1 else ""
    return f"{child.host} {child.role}-{child.index}{gen}"
