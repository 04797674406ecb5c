"""`mopd-logs summarize RUN_DIR|JOB_ID [--json] [--plot out.png]`: one screen about a run (or its --json).

The summary is of one job: the job id given, else the run dir's latest job (other jobs that reused the run
dir are listed, never counted as this job's failure). A job id is looked up in the job index (`mopd_hpc.logs.index`, under `$XDG_STATE_HOME`); the environment is
read here, at the edge, and nowhere below.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO

from rich.console import Console

from mopd_hpc.logs.index import JobIndexError, find_run_dir, index_key, state_home_from_env
from mopd_hpc.logs.plot import PlotError, plot_summary
from mopd_hpc.logs.render import render_summary
from mopd_hpc.logs.sacct import SacctRunner
from mopd_hpc.logs.summary import RunDirMissingError, no_sacct, summarize_run
from mopd_hpc.runtime.jobids import JobIdError
from mopd_hpc.runtime.signals import EXIT_USAGE

HELP = "summarize a run: job state, children per node, the first failure and its cause, training progress"
#: Exit code when the summary found a failure (so scripts can branch on it).
EXIT_FAILED_RUN = 1


class PipeConsole(Console):
    """A rich Console that lets a closed pipe (`mopd-logs summarize ... | head -3`) raise BrokenPipeError, which
    `cli.base.dispatch` turns into a quiet exit 141 as for `mopd-logs tail`; rich's own handler exits 1, the
    code of a failed run."""

    def on_broken_pipe(self) -> None:
        self.quiet = True  # drop what is still buffered
        raise BrokenPipeError("the reader of the summary closed the pipe")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "target", metavar="RUN_DIR|JOB_ID", help="a run directory, or a job id from mopd-submit"
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON (docs/en/logs.md)")
    parser.add_argument(
        "--plot", metavar="PNG", help="also write losses, reverse KL and accuracy to this PNG"
    )
    parser.add_argument("--no-sacct", action="store_true", help="do not ask Slurm accounting")


def resolve_target(target: str, env: Mapping[str, str]) -> Path:
    """A directory as given; otherwise a job id looked up in the job index of `env`'s state home.

    Raises:
        JobIndexError: `target` is neither an existing directory nor an indexed job id.
    """
    path = Path(target).expanduser()
    if path.is_dir():
        return path
    try:
        index_key(target)
    except JobIdError:
        raise JobIndexError(
            f"{target!r} is neither a run directory nor a job id (123, 123+1, local-42)"
        ) from None
    return find_run_dir(target, state_home_from_env(env))


def run(
    args: argparse.Namespace,
    out: TextIO | None = None,
    err: TextIO | None = None,
    env: Mapping[str, str] | None = None,
    sacct_runner: SacctRunner | None = None,
) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        run_dir = resolve_target(args.target, os.environ if env is None else env)
        job_id = None if Path(args.target).expanduser().is_dir() else args.target
        if args.no_sacct:
            sacct_runner = no_sacct
        summary = summarize_run(run_dir, sacct_runner=sacct_runner, job_id=job_id)
    except (JobIndexError, RunDirMissingError) as exc:
        print(f"mopd-logs summarize: {exc}", file=err)
        return EXIT_USAGE
    if args.json:
        out.write(summary.to_json() + "\n")
    else:
        render_summary(summary, PipeConsole(file=out, width=max(100, Console().width), soft_wrap=False))
    if args.plot:
        try:
            plot_summary(summary, args.plot)
        except PlotError as exc:
            print(f"mopd-logs summarize: {exc}", file=err)
            return EXIT_USAGE
    return EXIT_FAILED_RUN if summary.first_failure is not None else 0
