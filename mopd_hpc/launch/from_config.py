"""`jobspec_from_config`: the JobSpec (what sbatch is asked for) of a RunConfig and its plan.

Heterogeneous shape: component 0 `trainer` (actor + teachers), component 1 `rollout`; colocated shape:
one component `group`. Each node runs one guard task, `guard_command` = the venv's `mopd-guard` with
`--plan run_dir/plan.json --bind auto` (the guard spawns its node's children from the plan and listens on
the node's address, so that other nodes reach it). `launchers/node.sh` appends `--run-dir`/`--job-id`.
"""

from __future__ import annotations

import os
from pathlib import Path

from mopd_hpc.config import RunConfig
from mopd_hpc.launch.jobspec import Component, JobSpec
from mopd_hpc.launch.rundir import RunDir
from mopd_hpc.plan.placement import place_children
from mopd_hpc.records.run_dir import PLAN_FILE
from mopd_hpc.runtime.plan import JobPlan

#: The repository's node launcher (beside the package in a source checkout / editable install).
LAUNCHER = Path(__file__).resolve().parents[2] / "launchers" / "node.sh"
#: `--bind` value that makes the guard resolve its own node's address.
BIND_AUTO = "auto"


def guard_command(python: str | os.PathLike[str], plan_path: str | os.PathLike[str]) -> tuple[str, ...]:
    """argv of the node guard: `<venv>/bin/mopd-guard` beside `python` (else `python -m mopd_hpc.cli.guard`),
    spawning from `plan_path` and binding the node's address."""
    script = Path(python).with_name("mopd-guard")
    head = (str(script),) if script.exists() else (str(python), "-m", "mopd_hpc.cli.guard")
    return (*head, "--plan", str(plan_path), "--bind", BIND_AUTO)


def jobspec_from_config(
    cfg: RunConfig,
    run_dir: str | os.PathLike[str],
    python: str | os.PathLike[str],
    plan: JobPlan | None = None,
) -> JobSpec:
    """The JobSpec of `cfg` with its run directory at `run_dir` (absolute) and guards run by `python`'s venv.

    Args:
        cfg: the validated run config.
        run_dir: the run directory every node sees (cfg.run_dir made absolute, or --run-dir).
        python: the interpreter whose venv holds `mopd-guard` (sys.executable at the CLI edge).
        plan: the job plan, for each component's roles (default: `plan.placement.place_children(cfg)`).
    Raises:
        JobSpecError: a value cannot be rendered into a working script. PlanError: the layout is invalid.
    """
    plan = plan or place_children(cfg)
    paths = RunDir.at(run_dir)
    cluster = cfg.cluster
    components = []
    for het_group, (name, group) in enumerate(cluster.groups().items()):
        components.append(
            Component(
                het_group=het_group,
                name=name,
                nodes=group.nodes,
                gpus_per_node=group.gpus_per_node,
                cpus_per_task=group.cpus_per_task,
                mem_gb=group.mem_gb,
                partition=group.partition,
                account=group.account,
                qos=group.qos,
                roles=plan.roles_in_group(het_group),
            )
        )
    return JobSpec(
        job_name=cfg.name,
        run_dir=str(paths.root),
        shape=cluster.shape,
        components=tuple(components),
        launcher=str(LAUNCHER),
        guard_command=guard_command(python, paths.root / PLAN_FILE),
        secret_file=str(paths.secret_file),
        time_min=cluster.time_min,
        signal=cluster.signal,
        requeue=cluster.requeue,
        # no requeue: no count (config/inert_fields.py)
        max_requeues=cluster.max_requeues if cluster.requeue else 0,
        checkpoint_grace_s=min(90, max(1, cluster.signal_lead_s - 10)),
        extra_sbatch=tuple(cluster.extra_sbatch),
    )
