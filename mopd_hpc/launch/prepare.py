"""Preparing a job from its run config, before anything is written or started: the pipeline `mopd-submit`
and `mopd-debug run` share.

`prepare_job` loads and validates the config (every error names the YAML path), resolves the models
(launch/model_check.py: hub ids → this host's cached snapshots, the files the children read opened), fixes the
run directory, places the children (plan/placement.py) and, unless the job is only reviewed (`--dry-run`,
`--render`), refuses what the job's roles do not run (`job_gaps`, config/rules.py), a memory plan over the
GPUs' memory (launch/memory_check.py) and, when the job runs here, a path the job reads that does not exist
here. What comes back (`PreparedJob`) is what the run directory and the sbatch script are written from
(launch/rundir.py `write_run_files`, launch/render.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mopd_hpc.config import RunConfig, load_run_config
from mopd_hpc.config.capabilities import OPT_IN_FIELD, OPT_IN_FLAG
from mopd_hpc.config.inert_fields import inert_warnings
from mopd_hpc.config.job_gaps import job_gaps
from mopd_hpc.config.parallel import ActorParallel, ParallelError
from mopd_hpc.config.problems import Problem
from mopd_hpc.config.rules import NOTHING_LET_THROUGH
from mopd_hpc.launch.from_config import jobspec_from_config
from mopd_hpc.launch.jobspec import JobSpec
from mopd_hpc.launch.memory_check import MemoryCheck, memory_check
from mopd_hpc.launch.model_check import prepare_models, unverified_model_warnings
from mopd_hpc.launch.paths import local_path_errors, path_warnings
from mopd_hpc.plan.placement import place_children
from mopd_hpc.plan.residency_plan import planned_residency, residency_modes, residency_warnings
from mopd_hpc.records.run_dir import CONFIG_FILE, PLAN_FILE
from mopd_hpc.runtime.plan import JobPlan, PlanError


class UsageError(ValueError):
    """A bad argument (run directory, resume target) or a job refused before it starts; the message says why."""


@dataclass(frozen=True, slots=True)
class PreparedJob:
    """A job ready to be written and started.

    Attributes:
        cfg: the resolved config (models resolved, `run_dir` absolute).
        path: the absolute run directory.
        plan: the job plan; the probe-only plan when asked for (`probe`) or when a role has no entry point.
        parallel: the actor's parallel layout.
        spec: what sbatch is asked for (launch/jobspec.py).
        memory: the memory check (its refusals are warnings for a reviewed or probe-only job).
        missing: the roles whose entry point this interpreter cannot import.
    """

    cfg: RunConfig
    path: Path
    plan: JobPlan
    parallel: ActorParallel
    spec: JobSpec
    memory: MemoryCheck
    missing: tuple[str, ...]

    def warnings(self) -> list[str]:
        """The config's warnings (`submit_warnings`), then the memory plan's refusals and its unchecked note."""
        memory = [*self.memory.refusals, *([self.memory.unchecked] if self.memory.unchecked else [])]
        return [*submit_warnings(self.cfg), *memory]


def prepare_job(
    config: str,
    overrides: Sequence[str],
    *,
    python: str,
    force_local: bool = False,
    run_dir: str | None = None,
    resume: str | None = None,
    probe: bool = False,
    review: bool = False,
) -> PreparedJob:
    """The job of `config` with `overrides` (module docstring), for the interpreter `python`.

    `review` (--dry-run, --render): the job is printed or written, not started: the model files are not opened
    and nothing but the config's own errors is refused. `probe`: every child runs the `probe` role.

    Raises:
        ConfigError: the config is invalid, or a model cannot be resolved or read (each problem named).
        PlanError, ParallelError, JobSpecError: the job cannot be placed or rendered.
        UsageError: a bad --resume target, or what the roles do not run, a memory plan over the GPUs' memory, a
            path missing here (the refusal lists them all).
    """
    cfg = load_run_config(config, overrides, force_local)
    cfg = prepare_models(cfg, config, check_files=not (review or probe))
    path = resolve_run_dir(cfg, run_dir, resume)
    cfg = cfg.model_copy(update={"run_dir": str(path)})
    plan = place_children(cfg)
    parallel = ActorParallel.from_config(cfg)
    missing = tuple(unrunnable_roles(plan))
    if probe or (missing and not review):
        plan = plan.as_probe()
    elif not review and (gaps := job_gaps(cfg)):
        raise UsageError(gaps_refusal(gaps))
    memory = memory_check(cfg)
    if not plan.probe and not review and memory.refusals:
        raise UsageError(memory_refusal(memory.refusals))
    runs_here = cfg.cluster.backend == "local" and not review
    if runs_here and not plan.probe and (absent := local_path_errors(cfg)):
        raise UsageError(
            bulleted(
                f"cluster.backend is local: {len(absent)} path(s) the job reads do not exist here "
                "(nothing was started):",
                absent,
            )
        )
    spec = jobspec_from_config(cfg, path, python, plan)
    return PreparedJob(cfg, path, plan, parallel, spec, memory, missing)


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
    no effect (`config/inert_fields.py`), the paths missing here, then the GPUs that do not fit with their
    `always` teachers resident (`plan/residency_plan.py`; none when the job cannot be placed: that error comes with the
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


def bulleted(head: str, problems: Sequence[str], tail: str = "") -> str:
    """`head`, then one '  - problem' line each (as a ConfigError lists them), then `tail`."""
    return "\n".join([head, *(f"  - {p}" for p in problems), *([tail] if tail else [])])


def memory_refusal(refusals: Sequence[str]) -> str:
    """The refusal of a memory plan over the GPUs' memory, one line per GPU that does not fit."""
    return bulleted(
        "the memory plan does not fit the GPU (plan/memory_fit.py; --dry-run prints it):", refusals
    )


def gaps_refusal(gaps: Sequence[Problem], head: str = "this config is valid but asks") -> str:
    """The refusal of what the job's roles do not run (`job_gaps`), one line per gap, with the way out: when
    any gap is unverified (`Problem.unverified`: written, not yet run on GPUs), the opt-in first
    (`--allow-unverified`, `allow_unverified: true`; config/capabilities.py), saying whether it lets all of
    them through."""
    unverified = sum(bool(gap.unverified) for gap in gaps)
    ways = "--dry-run/--render to review it, or --probe to run the control plane of this shape"
    if unverified:
        opt_in = f"{OPT_IN_FLAG} ({OPT_IN_FIELD}: true)"
        if unverified == len(gaps):
            ways = f"{opt_in} to run it with these {unverified} setting(s) unverified, {ways}"
        else:
            rest = len(gaps) - unverified
            ways = f"{opt_in} to let the {unverified} unverified one(s) through (the other {rest} still refuse), {ways}"
    return bulleted(
        f"{head} for what the job's roles do not run yet ({len(gaps)}):",
        [gap.render() for gap in gaps],
        f"use {ways}",
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


def resolve_run_dir(cfg: RunConfig, run_dir: str | None, resume: str | None) -> Path:
    """The absolute run directory: --resume, else --run-dir, else the config's (relative to the cwd).

    Raises:
        UsageError: --resume names a directory that holds no earlier run (no plan.json, no config.yaml).
    """
    path = Path(resume or run_dir or cfg.run_dir).expanduser().absolute()
    if resume is not None and not ((path / PLAN_FILE).exists() or (path / CONFIG_FILE).exists()):
        raise UsageError(
            f"--resume {resume!r}: {path} holds no earlier run ({PLAN_FILE} or {CONFIG_FILE}); "
            "pass the run directory of a submitted job, or use --run-dir for a new one"
        )
    return path


__all__ = [
    "PreparedJob",
    "UsageError",
    "bulleted",
    "gaps_refusal",
    "memory_refusal",
    "prepare_job",
    "resolve_run_dir",
    "submit_warnings",
    "summary",
    "unrunnable_roles",
]
