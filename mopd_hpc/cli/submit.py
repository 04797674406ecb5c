"""`mopd-submit`: validate a run config, print it resolved, and (issue 5) render and submit the job.

    mopd-submit --check configs/local_cpu.yaml           # validate + print the resolved config; exit 0 or 2
    mopd-submit configs/local_cpu.yaml --local --set steps=3

Exit codes: 0 valid, 2 (EXIT_USAGE) a config error (every problem on stderr, one per line).
Structure (STYLE.md rule 13): a thin CLI over functions that take their collaborators —
`load_run_config` (mopd_hpc.config.loader) and `print_config(cfg, out)`; issue 5 adds `--dry-run`,
`--render PATH` and submission as more functions behind the same parser.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TextIO

from mopd_hpc.cli.base import EXIT_USAGE
from mopd_hpc.config import ConfigError, RunConfig, load_run_config

HELP = "Validate a run config and print it resolved (--check); submission lands with issue 5."
#: Printed (stderr) when submission is asked for before issue 5 lands.
NOT_YET = "mopd-submit: submission lands with issue 5; validating only (as --check)"

__all__ = ["HELP", "add_arguments", "load_run_config", "main", "print_config", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="the run config (YAML), e.g. configs/local_cpu.yaml")
    parser.add_argument(
        "--check", action="store_true", help="validate, print the resolved config, exit 0 (valid) or 2"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a value, e.g. --set loss.correction=mask --set data.sources[0].route=legs "
        "(VALUE is YAML: 1, 1e-4, true, null, [a, b]); repeatable, applied in order",
    )
    parser.add_argument(
        "--local",
        action="store_true",
        help="run on this machine (cluster.backend=local), whatever the YAML says",
    )


def summary(cfg: RunConfig) -> str:
    """One line: name, backend, shape, models, routes, sources, steps."""
    cluster = cfg.cluster
    groups = ", ".join(f"{n} {g.nodes}×{g.gpus_per_node} GPU" for n, g in cluster.groups().items())
    return (
        f"{cfg.name}: backend {cluster.backend}, shape {cluster.shape} ({groups}); actor "
        f"{cfg.models.actor.id}, teachers {', '.join(cfg.models.teacher_ids)}; routes {', '.join(cfg.routes)}; "
        f"{len(cfg.data.sources)} source(s); {cfg.steps} steps of {cfg.data.batch_size} prompts"
    )


def print_config(cfg: RunConfig, out: TextIO, source: str = "") -> None:
    """Print the resolved config as syntax-highlighted YAML (plain text when `out` is not a terminal)."""
    from rich.console import Console
    from rich.syntax import Syntax

    console = Console(file=out, soft_wrap=True)
    console.print(f"# {source or 'config'} is valid — {summary(cfg)}", markup=False, highlight=False)
    for warning in cfg.warnings():
        console.print(f"# warning: {warning}", markup=False, highlight=False)
    console.print(
        Syntax(cfg.to_yaml(), "yaml", theme="ansi_dark", background_color="default", word_wrap=False)
    )


def check(config: str, overrides: Sequence[str], force_local: bool, out: TextIO, err: TextIO) -> int:
    """Load, validate and print; returns 0, or EXIT_USAGE with every problem on `err`."""
    try:
        cfg = load_run_config(config, overrides, force_local)
    except ConfigError as exc:
        print(str(exc), file=err)
        return EXIT_USAGE
    print_config(cfg, out, source=config)
    return 0


def run(args: argparse.Namespace) -> int:
    if not args.check:
        print(NOT_YET, file=sys.stderr)
    return check(args.config, args.overrides, args.local, sys.stdout, sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mopd-submit", description=__doc__.split("\n\n")[0] if __doc__ else ""
    )
    add_arguments(parser)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
