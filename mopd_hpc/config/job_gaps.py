"""What the job's roles do not run: `job_gaps(cfg)`, one `Problem` per valid setting that `mopd-submit
--check` (and so every submit) refuses (`config/rules.py` `config_warnings` lists them first, for --dry-run
and --render, which still show such a config).

Every refusal is derived from the declarations of `config/capabilities.py` (what each actor engine, teacher
engine, rollout backend and weight-sync backend runs); each names the field, its value and the way out, so
the user changes that field (or waits for the role that runs it) instead of a job that fails after the
queue wait, or a substitute engine silently. A refusal of code that is written but has not run on GPUs here
(`Problem.unverified`) names `allow_unverified: true` as a way out too; with it set, `job_gaps` leaves it
out and `unverified_gaps` lists it, a warning (`unverified_warning`) that --check prints, the run dir keeps
(records/unverified.py) and `mopd-logs summarize` shows.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import Any

from mopd_hpc.config.actor_refusals import actor_refusals, loss_refusals, moe_refusals
from mopd_hpc.config.capabilities import OPT_IN_FIELD, ROLLOUT_BACKENDS, standing
from mopd_hpc.config.parallel import actor_world
from mopd_hpc.config.problems import Problem, show
from mopd_hpc.config.serving_refusals import (
    rollout_refusals,
    teacher_refusals,
    version_refusals,
    weight_sync_refusals,
)


def job_gaps(cfg: Any) -> list[Problem]:
    """Valid settings of a loaded RunConfig that the job's roles do not run, one problem each, in the order:
    the actor's shape, the teachers, the rollout backend, the weight sync, the loss (`config/capabilities.py`
    says what runs; README "What --check refuses" lists it); with `cfg.allow_unverified` the unverified ones
    are left out (`unverified_gaps`)."""
    return standing(_all_gaps(cfg), cfg.allow_unverified)


def unverified_gaps(cfg: Any) -> list[Problem]:
    """The refusals `cfg.allow_unverified` lets through: written code not yet run on GPUs ([] without it)."""
    return [p for p in _all_gaps(cfg) if p.unverified] if cfg.allow_unverified else []


def unverified_warning(problem: Problem) -> str:
    """The warning of an unverified setting let through: `<path> = <value> (not run on GPUs here; let through
    by allow_unverified): <the refusal's message>` (the message names the GPU test that has not run)."""
    return (
        f"{problem.path} = {show(problem.got)} (not run on GPUs here; let through by {OPT_IN_FIELD}): "
        f"{problem.message}"
    )


def _all_gaps(cfg: Any) -> list[Problem]:
    actor, group = cfg.models.actor, cfg.cluster.trainer_group
    device = "gpu" if group.gpus_per_node else "cpu"
    world = actor_world(cfg.cluster, cfg.rollout)
    out: list[Problem] = []
    if world.size > 0:  # else config/rules.py reports the rollout engines taking every GPU
        out += actor_refusals(
            actor.engine,
            device,
            world.size,
            actor.tensor_parallel,
            actor.pipeline_parallel,
            how=world.how,
            group_path=world.group_path,
        )
    estimator = cfg.loss.estimator if cfg.loss.distillation_coefficient > 0 else None
    teacher_device = "gpu" if cfg.cluster.teacher_group.gpus_per_node else "cpu"  # the teachers' group
    for i, teacher in enumerate(cfg.models.teachers):
        out += teacher_refusals(i, teacher.engine, teacher_device, teacher.tensor_parallel, estimator)
    out += rollout_refusals(cfg.rollout.backend, cfg.rollout.engines.tensor_parallel)
    out += _backend_package(cfg)
    out += weight_sync_refusals(
        cfg.weight_sync.backend, actor.engine, cfg.rollout.backend, cfg.rollout.mode, device, world.size
    )
    out += loss_refusals(actor.engine, cfg.loss)
    return out + moe_refusals(
        actor.engine, cfg.rollout.backend, cfg.loss, cfg.rollout.routing_replay, actor.expert_parallel,
        world=world.size, tensor_parallel=actor.tensor_parallel, pipeline_parallel=actor.pipeline_parallel,
        weight_sync=cfg.weight_sync.backend,
    )  # fmt: skip


def installed_version(package: str) -> str | None:
    """The installed distribution's version of `package` (importlib.metadata), None when not installed."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _backend_package(cfg: Any) -> list[Problem]:
    """The rollout backend's package where the job will run: on the local backend that is this machine, so
    an sglang whose version is outside the range the role has run with (`serving_refusals.version_refusals`) is
    refused; one that does not import here is a warning (`backend_package_warning`): the role checks the
    version at its start (on Slurm it is the rollout nodes', which the submit host cannot see:
    `config_warnings` says so, and the role checks at start)."""
    package = ROLLOUT_BACKENDS[cfg.rollout.backend].package
    if package is None or cfg.cluster.backend != "local" or importlib.util.find_spec(package) is None:
        return []
    return version_refusals(cfg.rollout.backend, installed_version(package))


def backend_package_warning(cfg: Any) -> list[str]:
    """With the local backend and the rollout backend's package not importable on this machine: one line
    saying the role checks the installed version at rollout start, naming the range and the install; else []."""
    spec = ROLLOUT_BACKENDS[cfg.rollout.backend]
    if spec.package is None or cfg.cluster.backend != "local" or importlib.util.find_spec(spec.package):
        return []
    problem = Problem(
        "rollout.backend",
        f"the {spec.name} backend's package {spec.package!r} does not import on this machine, where cluster.backend "
        f"local runs the job: the rollout role checks the installed version ({spec.package}{spec.version_range}) "
        "at rollout start and stops the job there without it",
        cfg.rollout.backend,
        f"install it here (pip install -e '.[{spec.package}]'), or rollout.backend: hf",
    )
    return [problem.render()]
