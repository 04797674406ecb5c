"""`mopd-submit`: validate a run config, plan the job, and render, print, submit or run it here.

    mopd-submit run.yaml [--check] [--dry-run] [--render PATH] [--local] [--set KEY=VALUE ...]
                         [--run-dir DIR] [--resume RUN_DIR] [--probe] [--allow-unverified]

- `--check`: validate and print the resolved config; exit 0, or 2 with every error, or with what the job's
  roles do not run (`job_gaps`, config/capabilities.py; listed after the models' problems too): if --check
  passes, the job's roles can run it. The
  models are checked here too (launch/model_check.py): a hub id is resolved through this host's Hugging Face
  cache (refused, with the command that fetches it, when the cache does not hold it), the model files the
  children read are opened (tokenizer, config.json, weight headers) and the tokenizers compared; every
  submission but --dry-run and --probe does the same, and the job receives the resolved snapshot directories.
- `--render PATH`: write the sbatch script to PATH and exit 0 (review or hand-edit it, then `sbatch` it).
- `--dry-run`: print the config warnings (as --check does, one a line), the rank map (component, node, role,
  index, GPUs, named ports, and the weight sync: AWEX transfer rank for `weight_sync.backend: awex`, torch
  broadcast rank for `torch`), the memory plan per GPU (`plan/memory_plan.py`), then the sbatch command
  and script; no Slurm needed.
- Every submit prints the config warnings before the rank map. A local run refuses (exit 2, before anything
  starts) a model directory or jsonl file that does not exist here, but for the tiny models `--local` builds
  on first use; a Slurm submit only warns (the path may exist on the cluster alone).
- `--local` (or `cluster.backend: local`): run the job on this machine through one guard (launch/local.py);
  exit code = the guard's. Otherwise (`slurm`): write run_dir/plan.json and run_dir/config.yaml, sbatch the
  script, print the job id and the commands to follow it, and record the job in the job index.
- `--allow-unverified` is `--set allow_unverified=true`: what is written but has not run on GPUs here
  (config/capabilities.py `unverified`) is a warning instead of a refusal; the resolved config.yaml records
  it, and the run dir's unverified.json (records/unverified.py) the warnings, which `mopd-logs summarize`
  shows. What is unsupported stays refused.
- `--run-dir DIR` replaces the config's run_dir; `--resume RUN_DIR` is the same for an existing run
  directory (the trainer resumes from its checkpoints/latest).
- `--probe` (hidden in --help, documented here): every child runs the `probe` role instead of its own,
  keeping its placement, GPUs and ports — a dry run of the whole job on real nodes. It is also used, with a
  notice, when a role's entry point is not installed yet.

Exit codes: 0 done; 2 (EXIT_USAGE) a config, plan or argument error (every problem on stderr); 1 sbatch
failed; a local run returns the guard's code. Structure (STYLE.md rule 13): a thin CLI over functions that
take their collaborators (`execute(args, out, err, environ, python)`); the pipeline is launch/'s: prepare the
job (launch/prepare.py), write the run dir (launch/rundir.py), run it here or submit it (launch/start.py),
shared with `mopd-debug run`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TextIO

from mopd_hpc.atomic import atomic_write_text
from mopd_hpc.config import ConfigError
from mopd_hpc.config.capabilities import OPT_IN_FIELD
from mopd_hpc.config.parallel import ParallelError
from mopd_hpc.launch.check import check
from mopd_hpc.launch.jobspec import JobSpecError
from mopd_hpc.launch.local_gpus import LocalGpuError
from mopd_hpc.launch.pipe_out import PipeOut
from mopd_hpc.launch.prepare import UsageError, prepare_job
from mopd_hpc.launch.resume import ResumeError
from mopd_hpc.launch.rundir import RunDirError, write_run_files
from mopd_hpc.launch.start import claim_run_dir, local_gpus, run_here, submit_to_slurm
from mopd_hpc.plan.memory_plan import format_memory_plan
from mopd_hpc.plan.residency_plan import planned_residency
from mopd_hpc.runtime.plan import PlanError
from mopd_hpc.runtime.run_lock import RunDirLockedError
from mopd_hpc.runtime.signals import EXIT_USAGE

#: Exit code after Ctrl-C (128 + SIGINT, the shell's convention).
EXIT_INTERRUPTED = 130
HELP = "plan a run config's job, then print (--dry-run), render (--render), run here (--local) or submit it"

__all__ = ["HELP", "add_arguments", "execute", "main", "run"]


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
    parser.add_argument(
        "--dry-run", action="store_true", help="print the sbatch script and the rank map, exit 0 (no Slurm)"
    )
    parser.add_argument(
        "--render", metavar="PATH", default=None, help="write the sbatch script to PATH, exit 0"
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--run-dir", metavar="DIR", default=None, help="run directory (replaces run_dir)")
    where.add_argument(
        "--resume", metavar="RUN_DIR", default=None, help="run again in an existing run directory (resumes)"
    )
    parser.add_argument(
        "--allow-unverified",
        action="store_true",
        help=f"run what is written but has not run on GPUs here (megatron TP/DP > 1, teacher TP > 1, AWEX from "
        f"several ranks) with a warning instead of a refusal: --set {OPT_IN_FIELD}=true",
    )
    parser.add_argument(
        "--probe",
        action="store_true",
        help="run the control plane of this shape only: every child is a probe that reports its environment "
        "(topology, GPUs, ports) and exits; `--local` or Slurm as the config says; no model is loaded",
    )


def execute(
    args: argparse.Namespace, *, out: TextIO, err: TextIO, environ: Mapping[str, str], python: str
) -> int:
    """Everything after argument parsing; collaborators passed in (streams, environment, interpreter)."""
    overrides = [*args.overrides, *([f"{OPT_IN_FIELD}=true"] if args.allow_unverified else [])]
    if args.check:
        return check(args.config, overrides, args.local, out, err)
    from rich.console import Console

    from mopd_hpc.launch.rankmap import print_rank_map
    from mopd_hpc.launch.render import render

    review = bool(args.render or args.dry_run)
    try:
        job = prepare_job(
            args.config,
            overrides,
            python=python,
            force_local=args.local,
            run_dir=args.run_dir,
            resume=args.resume,
            probe=args.probe,
            review=review,
        )
        if job.missing and not args.probe and not review:
            print(
                f"mopd-submit: note: role(s) {', '.join(job.missing)} have no entry point installed yet: running "
                "the probe-only plan (every child runs the `probe` role in its place; see --probe)",
                file=err,
            )
        request = render(job.spec)
    except (ConfigError, PlanError, ParallelError, JobSpecError, UsageError) as exc:
        print(str(exc) if isinstance(exc, ConfigError) else f"mopd-submit: {exc}", file=err)
        return EXIT_USAGE
    cfg, plan, path = job.cfg, job.plan, job.path
    console = Console(file=out, soft_wrap=False, width=None if out.isatty() else 160)
    rank_map = (plan, console, cfg.weight_sync.backend, cfg.weight_sync.awex_mode, job.parallel)
    if args.dry_run:
        for warning in job.warnings():
            print(f"# warning: {warning}", file=out)
        if cfg.cluster.backend == "local":
            print(
                "# cluster.backend is local: the job runs here, without Slurm (one guard, the rank map below);"
                " the script after it is what `cluster.backend: slurm` would submit",
                file=out,
            )
        print_rank_map(*rank_map)
        decision, gpus = planned_residency(cfg, plan)
        for line in format_memory_plan(gpus) + decision.lines:
            print(line, file=out)
        print(request.show(), file=out)
        return 0
    runs_here = cfg.cluster.backend == "local" and not args.render
    try:
        gpus = local_gpus(cfg, environ) if runs_here else ()
        claimed = claim_run_dir(path, cfg, runs_here)
    except (RunDirError, ResumeError, LocalGpuError, RunDirLockedError) as exc:
        print(f"mopd-submit: {exc}", file=err)
        return EXIT_USAGE
    for warning in job.warnings():  # as --check prints them, before the rank map
        print(f"# warning: {warning}", file=out)
    for line in claimed.skipped:  # a damaged newer checkpoint: the actor passes over it too
        print(f"# warning: checkpoint skipped: {line}", file=out)
    write_run_files(claimed.run_dir, cfg, plan)
    if args.render:  # the run dir is prepared as for a submission, so the script runs as written
        Path(args.render).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.render, request.script)
        print(
            f"wrote the sbatch script of {cfg.name!r} to {args.render} and prepared its run dir {path} "
            f"(config.yaml, plan.json, job token); submit it with: sbatch {shlex.quote(args.render)}, "
            f"follow it with: mopd-logs summarize {shlex.quote(str(path))}",
            file=out,
        )
        return 0
    if claimed.resumed_from is not None:
        print(f"resuming the run in {path} from checkpoints/{claimed.resumed_from}", file=out)
    print_rank_map(*rank_map)
    if runs_here:
        return run_here(
            plan,
            claimed,
            args.config,
            out=out,
            err=err,
            environ=environ,
            python=python,
            console=console,
            gpus=gpus,
        )
    return submit_to_slurm(
        cfg, plan, request, claimed.run_dir, args.config, out=out, err=err, environ=environ, python=python
    )


def run(args: argparse.Namespace) -> int:
    """`execute` on this process's streams (a closed reader is no error: launch/pipe_out.py); Ctrl-C before
    or after the job (while it runs, launch/local.py forwards it to the guard) exits 130 without a traceback."""
    out, err = PipeOut(sys.stdout), PipeOut(sys.stderr)
    try:
        return execute(args, out=out, err=err, environ=dict(os.environ), python=sys.executable)  # type: ignore[arg-type]
    except KeyboardInterrupt:
        print("mopd-submit: interrupted", file=err)  # type: ignore[arg-type]
        return EXIT_INTERRUPTED


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mopd-submit", description=__doc__.split("\n\n")[0] if __doc__ else ""
    )
    add_arguments(parser)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
