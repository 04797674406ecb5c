"""`mopd-debug run run.yaml [--probe] [--run-dir DIR] [--set K=V]`: the job's steps in the foreground,
inside an `salloc` allocation.

The same plan, run directory, node launcher and guard as the batch script: one `srun [--het-group=N]` per
component within the allocation, each node's guard spawning its children from `run_dir/plan.json`. The
child logs are printed live with `[host role-index]` prefixes; Ctrl-C stops every guard (children killed,
leases released) and exits 130. When a step ends with code 0 the others get `--end-grace-s` to end on their
own (the job end is announced in the run dir); those still running then are stopped, not counted as failed.
The allocation must fit the config (het groups, node counts, and CPUs per task: each group's nodes hold at
least its cpus_per_task), else exit 2 with the `salloc` command that fits; outside an allocation, exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from mopd_hpc.atomic import atomic_write_json
from mopd_hpc.records.run_dir import JOB_FILE
from mopd_hpc.runtime.signals import EXIT_USAGE

if TYPE_CHECKING:
    from mopd_hpc.launch.debug_session import Allocation
    from mopd_hpc.launch.jobspec import JobSpec

HELP = "inside salloc: start the job's steps in the foreground with live role-prefixed logs (Ctrl-C stops)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="the run config (YAML), e.g. configs/slurm_het_cpu.yaml")
    parser.add_argument("--run-dir", default=None, help="run directory (replaces the config's run_dir)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a value"
    )
    parser.add_argument(
        "--probe", action="store_true", help="every child runs the `probe` role (a dry run on real nodes)"
    )
    parser.add_argument(
        "--stop-wait-s", type=float, default=30.0, help="after Ctrl-C, seconds before srun kills the steps"
    )
    parser.add_argument(
        "--end-grace-s",
        type=float,
        default=30.0,
        help="after a step ends with code 0, seconds the others get to end on their own before Ctrl-C",
    )


def write_job_state(run_dir: Path, alloc: Allocation, spec: JobSpec) -> None:
    """`run_dir/state/job.json` as the batch shell writes it (what `mopd-logs summarize` reads)."""
    (run_dir / JOB_FILE).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(
        run_dir / JOB_FILE,
        {
            "job_id": alloc.job_id,
            "restart_count": 0,
            "shape": spec.shape,
            "components": [c.name for c in spec.components],
            "debug_run": True,
        },
    )


def config_salloc_hint(args: argparse.Namespace) -> str:
    """`; for this config: `salloc -N1 -c2 : -N2 -c1 mopd-debug run CONFIG`` from the config's het groups alone
    (loaded and validated, its models not resolved, nothing placed: quick); "" when the config does not load
    (its errors come when it is run inside an allocation)."""
    from mopd_hpc.config import ConfigError, load_run_config
    from mopd_hpc.launch.debug_session import salloc_for

    try:
        groups = list(load_run_config(args.config, args.overrides).cluster.groups().values())
    except (ConfigError, OSError, ValueError):
        return ""
    salloc = salloc_for([g.nodes for g in groups], [g.cpus_per_task for g in groups])
    return f"; for this config: `{salloc} mopd-debug run {args.config}`"


def execute(
    args: argparse.Namespace, *, out: TextIO, err: TextIO, environ: Mapping[str, str], python: str
) -> int:
    """Everything after argument parsing; collaborators passed in. Outside an allocation (no SLURM_JOB_ID) it
    refuses at once, before the job is prepared, with the `salloc` command that fits the config. Else the job
    is prepared and its run dir written as `mopd-submit` does (launch/prepare.py, launch/rundir.py), then
    started in this allocation."""
    from mopd_hpc.config import ConfigError
    from mopd_hpc.config.parallel import ParallelError
    from mopd_hpc.launch.debug_session import (
        Allocation,
        DebugSessionError,
        OutsideAllocationError,
        check_fit,
        run_steps,
        step_argvs,
    )
    from mopd_hpc.launch.jobspec import JobSpecError
    from mopd_hpc.launch.prepare import UsageError, prepare_job
    from mopd_hpc.launch.rundir import RunDirError, prepare_run_dir, write_run_files
    from mopd_hpc.launch.start import record_in_job_index
    from mopd_hpc.runtime.plan import PlanError

    try:
        alloc = Allocation.from_env(environ)  # first: outside salloc, refuse before the job is prepared
    except OutsideAllocationError as exc:
        print(f"mopd-debug run: {exc}{config_salloc_hint(args)}", file=err)
        return EXIT_USAGE
    except DebugSessionError as exc:
        print(f"mopd-debug run: {exc}", file=err)
        return EXIT_USAGE
    try:
        job = prepare_job(args.config, args.overrides, python=python, run_dir=args.run_dir, probe=args.probe)
        plan, spec = job.plan, job.spec
        cpus = [g.cpus_per_task for g in job.cfg.cluster.groups().values()]
        check_fit(alloc, plan, cpus)
        run_dir = prepare_run_dir(job.path)
    except (
        ConfigError,
        DebugSessionError,
        PlanError,
        ParallelError,
        JobSpecError,
        RunDirError,
        UsageError,
    ) as exc:
        print(str(exc) if isinstance(exc, ConfigError) else f"mopd-debug run: {exc}", file=err)
        return EXIT_USAGE
    write_run_files(run_dir, job.cfg, plan)
    write_job_state(run_dir.root, alloc, spec)
    record_in_job_index(
        alloc.job_id, run_dir, job.cfg.name, args.config, environ, err
    )  # `mopd-logs summarize JOB`
    groups = ", ".join(f"{g.name}: {','.join(h)}" for g, h in zip(plan.groups, alloc.groups, strict=True))
    print(f"[debug run] job {alloc.job_id} ({groups}); run dir {run_dir.root}; Ctrl-C stops", file=out)
    try:
        return run_steps(
            step_argvs(spec),
            run_dir.root,
            environ=environ,
            out=out,
            python=python,
            stop_wait_s=args.stop_wait_s,
            end_grace_s=args.end_grace_s,
        )
    except DebugSessionError as exc:
        print(f"mopd-debug run: {exc}", file=err)
        return EXIT_USAGE


def run(args: argparse.Namespace) -> int:
    return execute(args, out=sys.stdout, err=sys.stderr, environ=dict(os.environ), python=sys.executable)
