"""`mopd-logs tail RUN_DIR [--role R] [--rank N] [-n LINES] [-f]`: child logs merged by time with
`[host role-index]` prefixes (`mopd_hpc.logs.tailing`); `-f` follows new lines (polling) until Ctrl-C."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TextIO

from mopd_hpc.logs.tailing import FOLLOW_POLL_S, find_child_logs, follow, known_roles, print_tail
from mopd_hpc.records.run_dir import LOGS_DIR
from mopd_hpc.runtime.signals import EXIT_USAGE

HELP = (
    "print the last lines of every child log, merged by their timestamps, with [host role-index] prefixes; "
    "-f follows"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR")
    parser.add_argument("--role", help="only this role (actor, teacher, rollout, probe)")
    parser.add_argument("--rank", type=int, help="only this child index within its role")
    parser.add_argument("-n", "--lines", type=int, default=20, help="last lines per log (default 20)")
    parser.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until Ctrl-C")
    parser.add_argument("--poll-s", type=float, default=FOLLOW_POLL_S, help=argparse.SUPPRESS)


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    run_dir = Path(args.run_dir)
    if not (run_dir / LOGS_DIR).is_dir():
        print(f"mopd-logs tail: {run_dir}/logs is not a directory: expected a run directory", file=err)
        return EXIT_USAGE
    if args.role is not None and args.role not in (roles := known_roles(run_dir)):
        print(
            f"mopd-logs tail: --role {args.role!r} is not a known role: expected one of {', '.join(roles)}",
            file=err,
        )
        return EXIT_USAGE
    logs = find_child_logs(run_dir, args.role, args.rank)
    if not logs and not args.follow:
        print(
            f"mopd-logs tail: no child logs in {run_dir}/logs (role={args.role}, rank={args.rank})", file=err
        )
        return 1
    offsets = print_tail(logs, out, args.lines)
    if args.follow:
        follow(run_dir, out, offsets, args.role, args.rank, poll_s=args.poll_s)
    return 0
