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
take their collaborators (`execute(args, out, err, environ, python)`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from mopd_hpc.atomic import atomic_write_text
from mopd_hpc.cli.base import EXIT_USAGE
from mopd_hpc.config import ConfigError, RunConfig, load_run_config
from mopd_hpc.config.capabilities import OPT_IN_FIELD
from mopd_hpc.config.gaps import unverified_gaps, unverified_warning
from mopd_hpc.config.inert import inert_warnings
from mopd_hpc.config.parallel import ActorParallel, ParallelError
from mopd_hpc.config.rules import NOTHING_LET_THROUGH, job_gaps
from mopd_hpc.launch.jobspec import JobSpecError
from mopd_hpc.launch.local_gpus import LocalGpuError, local_gpu_tokens
from mopd_hpc.launch.memory_check import memory_check
from mopd_hpc.launch.model_check import prepare_models, resolution_notes, unverified_model_warnings
from mopd_hpc.launch.paths import local_path_errors, path_warnings
from mopd_hpc.launch.pipe_out import PipeOut
from mopd_hpc.launch.resume import ResumeError, check_resume, resume_choice
from mopd_hpc.launch.rundir import RunDir, RunDirError, prepare_run_dir
from mopd_hpc.plan.memory_plan import format_memory_plan
from mopd_hpc.plan.placement import place_children
from mopd_hpc.plan.residency_plan import planned_residency, residency_modes, residency_warnings
from mopd_hpc.records.run_dir import CONFIG_FILE
from mopd_hpc.records.unverified import write_unverified
from mopd_hpc.runtime import run_lock
from mopd_hpc.runtime.plan import PLAN_FILE_NAME, JobPlan, PlanError
from mopd_hpc.runtime.run_lock import RunDirLockedError, RunLock

#: Exit code after Ctrl-C (128 + SIGINT, the shell's convention).
EXIT_INTERRUPTED = 130
HELP = "plan a run config's job, then print (--dry-run), render (--render), run here (--local) or submit it"
#: Exit code when sbatch refused the job or could not be run.
EXIT_SUBMIT_FAILED = 1
#: The resolved config, written into the run directory (what `--resume` and mopd-logs read).
CONFIG_FILE_NAME = CONFIG_FILE

__all__ = ["HELP", "add_arguments", "check", "execute", "load_run_config", "main", "print_config", "run"]


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


def summary(cfg: RunConfig) -> str:
    """One line: name, backend, shape, models, routes, sources, steps."""
    cluster = cfg.cluster
    groups = ", ".join(f"{n} {g.nodes}×{g.gpus_per_node} GPU" for n, g in cluster.groups().items())
    return (
        f"{cfg.name}: backend {cluster.backend}, shape {cluster.shape} ({groups}); actor "
        f"{cfg.models.actor.id}, teachers {', '.join(cfg.models.teacher_ids)}; routes {', '.join(cfg.routes)}; "
        f"{len(cfg.data.sources)} source(s); {cfg.steps} steps of {cfg.data.batch_size} prompts"
    )


def submit_warnings(cfg: RunConfig, cwd: Path | None = None) -> list[str]:
    """Every warning --check prints: the config's own (`RunConfig.warnings`), the fields set where they have
    no effect (`config/inert.py`), the paths missing here, then the GPUs that do not fit with their `always`
    teachers resident (`plan/residency_plan.py`; none when the job cannot be placed: that error comes with the
    plan). A plan over the GPUs' memory is not a warning: `memory_check` refuses it."""
    inert = [p.render() for p in inert_warnings(cfg)]
    models = [f"unverified: {w}" for w in unverified_model_warnings(cfg, cwd)]  # a checkpoint family
    own = [w for w in cfg.warnings() if not (models and w == NOTHING_LET_THROUGH)]
    return [*own, *inert, *models, *path_warnings(cfg, cwd), *_residency_warnings(cfg)]


def _residency_warnings(cfg: RunConfig) -> list[str]:
    if not any(g.capacity_field for g in cfg.cluster.groups().values()):
        return []
    try:
        plan = place_children(cfg)
    except (PlanError, ParallelError):
        return []
    _, gpus = planned_residency(cfg, plan)
    return residency_warnings(gpus, residency_modes(cfg))


def _memory_refusal(refusals: Sequence[str]) -> str:
    return _bulleted(
        "the memory plan does not fit the GPU (plan/memory_fit.py; --dry-run prints it):", refusals
    )


def _bulleted(head: str, problems: Sequence[str], tail: str = "") -> str:
    """`head`, then one '  - problem' line each (as a ConfigError lists them), then `tail`."""
    return "\n".join([head, *(f"  - {p}" for p in problems), *([tail] if tail else [])])


def print_config(cfg: RunConfig, out: TextIO, source: str = "", notes: Sequence[str] = ()) -> None:
    """Print the resolved config as syntax-highlighted YAML (plain text when `out` is not a terminal), after
    its header, the `notes` (hub ids resolved) and the warnings as comment lines."""
    from rich.console import Console
    from rich.syntax import Syntax

    from mopd_hpc.launch.rankmap import shape_line

    console = Console(file=out, soft_wrap=True)
    console.print(f"# {source or 'config'} is valid — {summary(cfg)}", markup=False, highlight=False)
    console.print(f"# {shape_line(ActorParallel.from_config(cfg))}", markup=False, highlight=False)
    for note in notes:
        console.print(f"# {note}", markup=False, highlight=False)
    for warning in submit_warnings(cfg):
        console.print(f"# warning: {warning}", markup=False, highlight=False)
    console.print(
        Syntax(cfg.to_yaml(), "yaml", theme="ansi_dark", background_color="default", word_wrap=False)
    )


def check(config: str, overrides: Sequence[str], force_local: bool, out: TextIO, err: TextIO) -> int:
    """Load, validate (the models' files too: launch/model_check.py) and print; returns 0, or EXIT_USAGE with
    every problem on `err`: the config's errors, else the models' problems and what the job's roles do not
    run (`job_gaps`, from config/capabilities.py; both, so that fetching a model does not reveal a refusal
    only then), else what the roles do not run. The rule: if --check passes, the job's roles can run it."""
    try:
        written = load_run_config(config, overrides, force_local)
    except ConfigError as exc:
        print(str(exc), file=err)
        return EXIT_USAGE
    try:
        cfg = prepare_models(written, config)
    except ConfigError as exc:
        print(str(exc), file=err)
        if gaps := job_gaps(written):  # the fields only: a hub id's resolution does not change them
            print(f"mopd-submit: {_gaps_refusal(gaps, 'its fields are valid, and it also asks')}", file=err)
        return EXIT_USAGE
    gaps, memory = job_gaps(cfg), memory_check(cfg)
    if gaps:
        print(f"mopd-submit: {_gaps_refusal(gaps)}", file=err)
    if memory.refusals:
        print(f"mopd-submit: {_memory_refusal(memory.refusals)}", file=err)
    if gaps or memory.refusals:
        return EXIT_USAGE
    notes = [*resolution_notes(written, cfg), *([memory.unchecked] if memory.unchecked else [])]
    print_config(cfg, out, source=config, notes=notes)
    return 0


def _gaps_refusal(gaps: Sequence[Any], head: str = "this config is valid but asks") -> str:
    return _bulleted(
        f"{head} for what the job's roles do not run yet ({len(gaps)}):",
        [gap.render() for gap in gaps],
        "use --dry-run/--render to review it, or --probe to run the control plane of this shape",
    )


def unrunnable_roles(plan: JobPlan) -> list[str]:
    """Roles of the plan whose entry-point module this interpreter cannot import (not written yet)."""
    from mopd_hpc.runtime.guard.roles import RoleModuleMissingError, RoleRegistry

    registry, missing = RoleRegistry.create(), []
    for role in dict.fromkeys(c.role for c in plan.children):
        try:
            registry.module_for(role)
        except RoleModuleMissingError:
            missing.append(role)
    return missing


class UsageError(ValueError):
    """A bad argument (run directory, resume target); the message names it."""


def resolve_run_dir(cfg: RunConfig, run_dir: str | None, resume: str | None) -> Path:
    """The absolute run directory: --resume, else --run-dir, else the config's (relative to the cwd).

    Raises:
        UsageError: --resume names a directory that holds no earlier run (no plan.json, no config.yaml).
    """
    path = Path(resume or run_dir or cfg.run_dir).expanduser().absolute()
    if resume is not None and not ((path / PLAN_FILE_NAME).exists() or (path / CONFIG_FILE_NAME).exists()):
        raise UsageError(
            f"--resume {resume!r}: {path} holds no earlier run ({PLAN_FILE_NAME} or {CONFIG_FILE_NAME}); "
            "pass the run directory of a submitted job, or use --run-dir for a new one"
        )
    return path


def execute(
    args: argparse.Namespace, *, out: TextIO, err: TextIO, environ: Mapping[str, str], python: str
) -> int:
    """Everything after argument parsing; collaborators passed in (streams, environment, interpreter)."""
    overrides = [*args.overrides, *([f"{OPT_IN_FIELD}=true"] if args.allow_unverified else [])]
    if args.check:
        return check(args.config, overrides, args.local, out, err)
    from rich.console import Console

    from mopd_hpc.launch.from_config import jobspec_from_config
    from mopd_hpc.launch.rankmap import print_rank_map
    from mopd_hpc.launch.render import render

    try:
        cfg = load_run_config(args.config, overrides, args.local)
        # hub ids → this host's cached snapshots (the job's config.yaml carries them); the files checked
        cfg = prepare_models(cfg, args.config, check_files=not (args.dry_run or args.probe))
        path = resolve_run_dir(cfg, args.run_dir, args.resume)
        cfg = cfg.model_copy(update={"run_dir": str(path)})
        plan = place_children(cfg)
        parallel = ActorParallel.from_config(cfg)
        missing = unrunnable_roles(plan)
        if missing and not args.probe and not args.render and not args.dry_run:
            print(
                f"mopd-submit: note: role(s) {', '.join(missing)} have no entry point installed yet: running the "
                "probe-only plan (every child runs the `probe` role in its place; see --probe)",
                file=err,
            )
        if args.probe or (missing and not args.render and not args.dry_run):
            plan = plan.as_probe()
        elif not args.render and not args.dry_run and (gaps := job_gaps(cfg)):
            raise UsageError(_gaps_refusal(gaps))
        memory = memory_check(cfg)
        if not plan.probe and not args.render and not args.dry_run and memory.refusals:
            raise UsageError(_memory_refusal(memory.refusals))
        runs_here = cfg.cluster.backend == "local" and not args.render and not args.dry_run
        if runs_here and not plan.probe and (absent := local_path_errors(cfg)):
            raise UsageError(
                _bulleted(
                    f"cluster.backend is local: {len(absent)} path(s) the job reads do not exist here "
                    "(nothing was started):",
                    absent,
                )
            )
        request = render(jobspec_from_config(cfg, path, python, plan))
    except (ConfigError, PlanError, ParallelError, JobSpecError, UsageError) as exc:
        print(str(exc) if isinstance(exc, ConfigError) else f"mopd-submit: {exc}", file=err)
        return EXIT_USAGE
    console = Console(file=out, soft_wrap=False, width=None if out.isatty() else 160)
    warnings = submit_warnings(cfg) + [*memory.refusals, *([memory.unchecked] if memory.unchecked else [])]
    if args.dry_run:
        for warning in warnings:
            print(f"# warning: {warning}", file=out)
        if cfg.cluster.backend == "local":
            print(
                "# cluster.backend is local: the job runs here, without Slurm (one guard, the rank map below);"
                " the script after it is what `cluster.backend: slurm` would submit",
                file=out,
            )
        print_rank_map(plan, console, cfg.weight_sync.backend, cfg.weight_sync.awex_mode, parallel)
        decision, gpus = planned_residency(cfg, plan)
        for line in format_memory_plan(gpus) + decision.lines:
            print(line, file=out)
        print(request.show(), file=out)
        return 0
    lock: RunLock | None = None
    try:
        gpus = _local_gpus(cfg, environ) if cfg.cluster.backend == "local" and not args.render else ()
        lock = run_lock.claim(  # a local job locks its run dir; a submission checks nobody holds it
            path, _local_job_id() if runs_here else None, socket.gethostname()
        )
        choice = resume_choice(path)
        resumed_from = check_resume(path, cfg, choice)
        run_dir = prepare_run_dir(path)
    except (RunDirError, ResumeError, LocalGpuError, RunDirLockedError) as exc:
        if lock is not None:
            lock.release()
        print(f"mopd-submit: {exc}", file=err)
        return EXIT_USAGE
    for warning in warnings:  # as --check prints them, before the rank map
        print(f"# warning: {warning}", file=out)
    for line in choice.skipped:  # a damaged newer checkpoint: the actor passes over it too
        print(f"# warning: checkpoint skipped: {line}", file=out)
    atomic_write_text(run_dir.root / CONFIG_FILE_NAME, cfg.to_yaml())
    write_unverified(
        run_dir.root, [unverified_warning(p) for p in unverified_gaps(cfg)] + unverified_model_warnings(cfg)
    )
    plan.write(run_dir.root / PLAN_FILE_NAME)
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
    if resumed_from is not None:
        print(f"resuming the run in {path} from checkpoints/{resumed_from}", file=out)
    print_rank_map(plan, console, cfg.weight_sync.backend, cfg.weight_sync.awex_mode, parallel)
    if cfg.cluster.backend == "local":
        return _run_local(
            plan,
            run_dir,
            args.config,
            out=out,
            err=err,
            environ=environ,
            python=python,
            console=console,
            gpus=gpus,
            lock=lock,
        )
    return _submit_slurm(
        cfg, plan, request, run_dir, args.config, out=out, err=err, environ=environ, python=python
    )


def _local_job_id() -> str:
    from mopd_hpc.launch.local import local_job_id  # lazily: launch.local imports the trainer's setup

    return local_job_id()


def _local_gpus(cfg: RunConfig, environ: Mapping[str, str]) -> tuple[str, ...]:
    """This machine's GPUs for a local job (shape colocated: the group's gpus_per_node), checked before
    anything starts. Raises LocalGpuError."""
    group = cfg.cluster.group
    if cfg.cluster.shape != "colocated" or group is None:
        return ()
    return local_gpu_tokens(environ, group.gpus_per_node, "cluster.group.gpus_per_node")


def _run_local(
    plan: JobPlan,
    run_dir: RunDir,
    config_path: str,
    *,
    out: TextIO,
    err: TextIO,
    environ: Mapping[str, str],
    python: str,
    console: object,
    gpus: Sequence[str] = (),
    lock: RunLock | None = None,
) -> int:
    from mopd_hpc.launch.local import local_job_id, run_local
    from mopd_hpc.launch.rankmap import probe_report_table, read_probe_reports

    job_id = local_job_id()
    # so that `mopd-logs summarize local-N` finds the run dir, as it does a Slurm job id
    record_in_job_index(job_id, run_dir, plan.name, config_path, environ, err)
    rc = run_local(
        plan, run_dir, python=python, environ=environ, out=out, job_id=job_id, gpus=gpus, lock=lock
    )
    if plan.probe:
        console.print(probe_report_table(read_probe_reports(run_dir.root)))  # type: ignore[attr-defined]
    print(f"[local] done: exit code {rc}; run dir {run_dir.root}", file=out)
    return rc


def _submit_slurm(
    cfg: RunConfig,
    plan: JobPlan,
    request: object,
    run_dir: RunDir,
    config_path: str,
    *,
    out: TextIO,
    err: TextIO,
    environ: Mapping[str, str],
    python: str,
) -> int:
    from mopd_hpc.launch.slurm import SubmitError, submit

    try:
        job = submit(request, environ)  # type: ignore[arg-type]
    except SubmitError as exc:
        print(f"mopd-submit: {exc}", file=err)
        return EXIT_SUBMIT_FAILED
    job_id = str(job.job_id)
    record_in_job_index(job_id, run_dir, cfg.name, config_path, environ, err)
    bindir = Path(python).parent
    rd = shlex.quote(str(run_dir.root))
    print(f"submitted job {job_id} ({cfg.name}); run dir {run_dir.root}", file=out)
    print("follow it:", file=out)
    print(f"  {bindir / 'mopd-logs'} summarize {job_id}", file=out)
    print(f"  {bindir / 'mopd-logs'} tail {rd} -f", file=out)
    for line in ports_commands(job_id, plan, bindir / "mopd-debug"):
        print(f"  {line}", file=out)
    print(f"  scancel {job_id}", file=out)
    return 0


def ports_commands(job_id: str, plan: JobPlan, mopd_debug: Path) -> list[str]:
    """The `srun --overlap mopd-debug ports` lines that list the port leases on a job's nodes: one per het
    group of a heterogeneous job (an srun reaches one component), else one."""
    debug = shlex.quote(str(mopd_debug))
    if plan.shape != "heterogeneous":
        return [f"srun --jobid={job_id} --overlap {debug} ports   # leases on its nodes"]
    return [
        f"srun --jobid={job_id} --het-group={g.het_group} --overlap {debug} ports   # leases on the {g.name} nodes"
        for g in plan.groups
    ]


def record_in_job_index(
    job_id: str, run_dir: RunDir, name: str, config: str, environ: Mapping[str, str], err: TextIO
) -> None:
    """Record the job in the job index (mopd_hpc.logs.index) when that module is installed."""
    try:
        from mopd_hpc.logs.index import append_job_index, state_home_from_env
    except ImportError:
        return
    import time

    entry = {
        "job_id": job_id,
        "run_dir": str(run_dir.root),
        "name": name,
        "submitted_at": time.time(),
        "config": str(Path(config).absolute()),
    }
    try:
        append_job_index(entry, state_home_from_env(environ))
    except (OSError, ValueError) as exc:
        print(f"mopd-submit: warning: job {job_id} not recorded in the job index: {exc}", file=err)


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
