"""`mopd-debug shell JOB_ID [--node NAME]`: an interactive shell on a node of a running job.

Runs `srun --jobid=JOB_ID [--het-group=N] --overlap --pty --nodes=1 --ntasks=1 --nodelist=NODE bash` (the
het group is the component holding the node, from `scontrol show job -o`), printing the node's rank
topology (`mopd-debug topology`) before the shell starts. The shell has MOPD_RUN_DIR (the run dir: from the
job's batch log path, else the job index of `mopd-submit`) and, in a het job, the job's SLURM_HET_SIZE and
the node's MOPD_HET_GROUP. `--print` shows the argv instead of running it.
Exit codes: the shell's; 2 (EXIT_USAGE) the job is unknown or not running, or the node is not one of its.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence

from mopd_hpc.launch.debug_session import DebugSessionError
from mopd_hpc.launch.debug_shell import job_run_dir, parse_scontrol_job, shell_argv
from mopd_hpc.runtime.signals import EXIT_USAGE

HELP = "open an interactive shell (srun --overlap --pty) on a node of a running job, topology first"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job_id", help="the job id (a het job's leader id, e.g. 123)")
    parser.add_argument("--node", default=None, help="the node (default: the job's first node)")
    parser.add_argument("--print", action="store_true", help="print the srun command instead of running it")


def scontrol_show_job(job_id: str) -> str:
    """`scontrol show job -o JOB_ID` (one line per component). Raises DebugSessionError when it fails."""
    try:
        proc = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DebugSessionError(f"scontrol show job {job_id} could not run: {exc}") from None
    if proc.returncode != 0:
        raise DebugSessionError(f"scontrol show job {job_id}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def indexed_run_dir(job_id: str, environ: Mapping[str, str]) -> str | None:
    """The run dir the job index (mopd_hpc.logs.index, under `environ`'s state home) records for `job_id`;
    None when the index does not hold it."""
    from mopd_hpc.logs.index import JobIndexError, find_run_dir, state_home_from_env

    try:
        return str(find_run_dir(job_id, state_home_from_env(environ)))
    except JobIndexError:
        return None


def build(
    job_id: str,
    node: str | None,
    show_job: Callable[[str], str] = scontrol_show_job,
    environ: Mapping[str, str] | None = None,
) -> list[str]:
    """The srun argv for `job_id`/`node`; the shell's MOPD_RUN_DIR is the job's run dir: from its batch log
    path (scontrol), else from the job index of `environ` (None: not looked up). Raises DebugSessionError
    (JobLookupError) naming the problem."""
    leader = job_id.split("+", 1)[0]
    components = parse_scontrol_job(show_job(leader))
    run_dir = job_run_dir(components)
    if run_dir is None and environ is not None:
        run_dir = indexed_run_dir(leader, environ)
    return shell_argv(leader, components, node, sys.executable, run_dir=run_dir)


def run(args: argparse.Namespace, exec_fn: Callable[[str, Sequence[str]], object] = os.execvp) -> int:
    try:
        argv = build(args.job_id, args.node, environ=dict(os.environ))
    except DebugSessionError as exc:
        print(f"mopd-debug shell: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.print:
        print(shlex.join(argv))
        return 0
    sys.stdout.flush()
    exec_fn(argv[0], argv)  # the edge: the shell replaces this process
    return 0
