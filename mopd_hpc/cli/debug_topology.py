"""`mopd-debug topology`: print the rank-topology descriptor of the current environment.

The environment is read here, at the edge, and passed to `RankTopology.from_env`.
Exit 0 with the descriptor (a rich table, or JSON with `--json`); exit 2 (EXIT_USAGE) with the
TopologyError message on stderr when the environment is unsupported or contradictory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import TextIO

from mopd_hpc.runtime import child_env
from mopd_hpc.runtime.signals import EXIT_USAGE
from mopd_hpc.runtime.topology import ROLES, RankTopology, TopologyError

HELP = "print this task's rank topology (het group, host, rank, GPUs) as a table or JSON"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--role", choices=ROLES, default=None, help="role to check the GPUs against")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument(
        "--local",
        action="store_true",
        help=f"local backend: ignore SLURM_*, ranks from {child_env.RANK}/{child_env.WORLD_SIZE}",
    )


def show_topology(
    env: Mapping[str, str],
    out: TextIO,
    err: TextIO,
    role: str | None = None,
    as_json: bool = False,
    local: bool = False,
) -> int:
    """Describe the task whose environment is `env` on `out`; return the exit code.

    Returns:
        0 on success; EXIT_USAGE (2) with the TopologyError message on `err`.
    """
    try:
        topo = RankTopology.from_env(env, role=role, backend="local" if local else None)
    except TopologyError as exc:
        print(f"mopd-debug topology: error: {exc}", file=err)
        return EXIT_USAGE
    data = topo.to_dict()
    if as_json:
        out.write(json.dumps(data, sort_keys=True) + "\n")
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"rank topology · job {topo.job_id} · {topo.backend}", show_header=True)
    table.add_column("field")
    table.add_column("value")
    for key, value in data.items():
        shown = (
            (", ".join(value) or "-") if isinstance(value, list) else ("-" if value is None else str(value))
        )
        table.add_row(key, shown)
    Console(file=out, width=120, no_color=not out.isatty()).print(table)
    return 0


def run(args: argparse.Namespace) -> int:
    return show_topology(
        dict(os.environ), sys.stdout, sys.stderr, role=args.role, as_json=args.json, local=args.local
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run this verb alone (`python -m mopd_hpc.cli.debug_topology`)."""
    parser = argparse.ArgumentParser(prog="mopd-debug topology", description=HELP)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
