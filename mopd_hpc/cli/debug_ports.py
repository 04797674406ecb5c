"""`mopd-debug ports [--json]`: list the port leases held on this node (every job and user) with owners."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import TextIO

from mopd_hpc.runtime.ports_registry import NodeLease, list_node_leases

HELP = "list the port leases on this node with their owners (job, role, index, pid, name)"
_COLUMNS = ("port", "name", "job_id", "role", "index", "generation", "pid", "child_pid", "uid")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.add_argument("--timeout-s", type=float, default=0.5, help="owner-record query timeout per lease")


def print_leases(leases: list[NodeLease], out: TextIO, as_json: bool) -> None:
    """Print `leases` as a JSON list or an aligned table (a silent holder shows `?` for its owner)."""
    if as_json:
        json.dump([x.to_dict() for x in leases], out, indent=2)
        out.write("\n")
        return
    rows = [list(_COLUMNS)]
    for x in leases:
        d = x.to_dict()
        rows.append([str(d[c]) if d[c] is not None else ("-" if x.answered else "?") for c in _COLUMNS])
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    for r in rows:
        out.write("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() + "\n")
    out.write(f"{len(leases)} lease(s)\n")


def run(
    args: argparse.Namespace,
    out: TextIO | None = None,
    lister: Callable[..., list[NodeLease]] = list_node_leases,
) -> int:
    print_leases(lister(timeout_s=args.timeout_s), out or sys.stdout, args.json)
    return 0
