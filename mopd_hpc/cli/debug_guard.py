"""`mopd-debug guard status RUN_DIR [--json]`: the children per node, from each guard's API.

Addresses come from `run_dir/guards/<host>.json`, the token from the run dir's 0600 token file (or
`--token-file`). A rich table (host, role, index, generation, pid, state, exit code/signal, ports); a guard
that does not answer is a row saying so. `--json`: `{"run_dir", "nodes": [{"host", "url", "reachable",
"error", "children": [{role, index, generation, pid, state, exit_code, signal, ports, stdout, stderr}],
"ports": [{role, index, name, port}]}]}`.
Exit codes: 0 every guard answered; 1 a guard did not answer; 2 (EXIT_USAGE) no guard record or no token.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from mopd_hpc.records.run_dir import GUARDS_DIR, TOKEN_FILE
from mopd_hpc.runtime.signals import EXIT_USAGE

HELP = "ask a run's guards for their children (guard status RUN_DIR [--json])"
#: Exit code when at least one guard did not answer.
EXIT_UNREACHABLE = 1
#: Seconds each guard gets to answer `GET /status`.
GUARD_STATUS_TIMEOUT_S = 3.0


class GuardStatusError(ValueError):
    """No guard record in the run dir, or its token file is unusable."""


@dataclass(frozen=True, slots=True)
class GuardNodeStatus:
    """One guard's answer: `children` (the guard's child status dicts) and `ports` (its leases), or
    `error` (why it did not answer) with both empty."""

    host: str
    url: str | None
    children: tuple[dict[str, Any], ...] = ()
    ports: tuple[dict[str, Any], ...] = ()
    error: str | None = None

    @property
    def reachable(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "url": self.url,
            "reachable": self.reachable,
            "error": self.error,
            "children": [{k: c.get(k) for k in CHILD_STATUS_KEYS} for c in self.children],
            "ports": list(self.ports),
        }


#: Keys of each child in `guard status --json` (a subset of the guard's child status).
CHILD_STATUS_KEYS = (
    "role",
    "index",
    "generation",
    "pid",
    "state",
    "exit_code",
    "signal",
    "ports",
    "stdout",
    "stderr",
)


def collect_guard_status(
    run_dir: str | os.PathLike[str],
    token_file: str | os.PathLike[str] | None = None,
    timeout_s: float = GUARD_STATUS_TIMEOUT_S,
    client_factory: Callable[..., Any] | None = None,
) -> list[GuardNodeStatus]:
    """Ask every guard recorded under `run_dir/guards/` for its status (hosts in name order).

    Args:
        token_file: the job's token file; default `run_dir/guard.token`.
        client_factory: `(url, token, timeout_s=, retries=) -> client with .status()`; default GuardClient.
    Raises:
        GuardStatusError: the run dir has no guard record, or the token file is unusable.
    """
    from mopd_hpc.records.job_token import GuardAuthError, read_token_file
    from mopd_hpc.runtime.guard.client import GuardClient, GuardError

    root = Path(run_dir)
    records = sorted((root / GUARDS_DIR).glob("*.json")) if (root / GUARDS_DIR).is_dir() else []
    if not records:
        raise GuardStatusError(
            f"no guard record under {root / GUARDS_DIR}: no guard of this run is up (a finished job's guards "
            f"remove theirs); see `mopd-logs summarize {shlex.quote(str(root))}`"
        )
    try:
        token = read_token_file(token_file or root / TOKEN_FILE)
    except GuardAuthError as exc:
        raise GuardStatusError(str(exc)) from None
    factory = client_factory or GuardClient
    out = []
    for path in records:
        host = path.stem
        try:
            url = str(json.loads(path.read_text(encoding="utf-8"))["url"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            out.append(GuardNodeStatus(host, None, error=f"unreadable guard record {path}: {exc}"))
            continue
        try:
            answer = factory(url, token, timeout_s=timeout_s, retries=0).status()
        except GuardError as exc:
            out.append(GuardNodeStatus(host, url, error=f"{type(exc).__name__}: {exc}"))
            continue
        out.append(
            GuardNodeStatus(
                str(answer.get("host") or host),
                url,
                tuple(answer.get("children", ())),
                tuple(answer.get("ports", ())),
            )
        )
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["status"], help="what to ask the guards (status)")
    parser.add_argument("run_dir", help="the run directory (holds guards/<host>.json and the token file)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument(
        "--token-file", default=None, help="the job's token file (default: RUN_DIR/guard.token)"
    )
    parser.add_argument(
        "--timeout-s", type=float, default=GUARD_STATUS_TIMEOUT_S, help="per-guard answer timeout, seconds"
    )


def _ended(child: dict) -> str:
    if child.get("signal"):
        return str(child["signal"])
    return "-" if child.get("exit_code") is None else str(child["exit_code"])


def print_status(run_dir: str, nodes: list[GuardNodeStatus], out: TextIO, as_json: bool) -> None:
    """Print the guards' answers as JSON (schema in the module docstring) or a table."""
    if as_json:
        out.write(json.dumps({"run_dir": run_dir, "nodes": [n.to_dict() for n in nodes]}, indent=2) + "\n")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"guards of {run_dir}")
    for column in ("host", "role", "index", "gen", "pid", "state", "exit/signal", "ports"):
        table.add_column(column)
    for node in nodes:
        if not node.reachable:
            table.add_row(
                node.host, "-", "-", "-", "-", "[red]guard unreachable[/red]", "-", node.error or ""
            )
            continue
        if not node.children:
            table.add_row(node.host, "-", "-", "-", "-", "no children", "-", "-")
        for c in node.children:
            ports = ", ".join(f"{k}={v}" for k, v in (c.get("ports") or {}).items()) or "-"
            row = (c.get("role"), c.get("index"), c.get("generation"), c.get("pid"), c.get("state"))
            table.add_row(node.host, *(str(x) for x in row), _ended(c), ports)
    Console(file=out, width=160, no_color=not out.isatty()).print(table)


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    try:
        nodes = collect_guard_status(args.run_dir, args.token_file, args.timeout_s)
    except GuardStatusError as exc:
        print(f"mopd-debug guard: {exc}", file=err)
        return EXIT_USAGE
    print_status(args.run_dir, nodes, out, args.json)
    return 0 if all(n.reachable for n in nodes) else EXIT_UNREACHABLE
