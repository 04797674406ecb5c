"""Starting a prepared job (launch/prepare.py): claiming its run directory, running it here or submitting it
to Slurm, and recording it in the job index, as `mopd-submit` and `mopd-debug run` do.

`claim_run_dir` locks the run directory (a local job holds the lock while it runs; a submission checks nobody
holds it: runtime/run_lock.py), checks that the config may resume there (launch/resume.py) and prepares it
(launch/rundir.py). `run_here` runs the job through one guard (launch/local.py), `submit_to_slurm` sbatches it
(launch/slurm.py) and prints the commands that follow it.
"""

from __future__ import annotations

import shlex
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from mopd_hpc.config import RunConfig
from mopd_hpc.launch.local_gpus import local_gpu_tokens
from mopd_hpc.launch.render import SbatchRequest
from mopd_hpc.launch.resume import check_resume, resume_choice
from mopd_hpc.launch.rundir import RunDir, prepare_run_dir
from mopd_hpc.logs.index import append_job_index, state_home_from_env
from mopd_hpc.runtime import run_lock
from mopd_hpc.runtime.plan import JobPlan
from mopd_hpc.runtime.run_lock import RunLock

#: Exit code when sbatch refused the job or could not be run.
EXIT_SUBMIT_FAILED = 1


@dataclass(frozen=True, slots=True)
class ClaimedRunDir:
    """A prepared run directory and what claiming it found.

    Attributes:
        run_dir: its paths (created, 0700, with the job token).
        lock: the run lock a local job holds while it runs (released when it ends); None for a submission.
        resumed_from: the checkpoint the run resumes from (`step_<n>`), None for a fresh start.
        skipped: the damaged newer checkpoints passed over, one line each.
    """

    run_dir: RunDir
    lock: RunLock | None
    resumed_from: str | None
    skipped: tuple[str, ...]


def claim_run_dir(path: Path, cfg: RunConfig, runs_here: bool) -> ClaimedRunDir:
    """Lock, check and prepare the run directory `path` of `cfg` (module docstring); `runs_here`: a local job.

    Raises:
        RunDirLockedError: another live job holds the run directory.
        ResumeError: the config may not resume there (launch/resume.py).
        RunDirError: the directory or its token cannot be made private to this user.
    """
    lock = run_lock.claim(path, _local_job_id() if runs_here else None, socket.gethostname())
    try:
        choice = resume_choice(path)
        resumed_from = check_resume(path, cfg, choice)
        run_dir = prepare_run_dir(path)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return ClaimedRunDir(run_dir, lock, resumed_from, tuple(choice.skipped))


def local_gpus(cfg: RunConfig, environ: Mapping[str, str]) -> tuple[str, ...]:
    """This machine's GPUs for a local job (shape colocated: the group's gpus_per_node), checked before
    anything starts; () for any other shape. Raises LocalGpuError."""
    group = cfg.cluster.group
    if cfg.cluster.shape != "colocated" or group is None:
        return ()
    return local_gpu_tokens(environ, group.gpus_per_node, "cluster.group.gpus_per_node")


def _local_job_id() -> str:
    from mopd_hpc.launch.local import local_job_id  # lazily: launch.local imports the trainer's setup

    return local_job_id()


def run_here(
    plan: JobPlan,
    claimed: ClaimedRunDir,
    config_path: str,
    *,
    out: TextIO,
    err: TextIO,
    environ: Mapping[str, str],
    python: str,
    console: object,
    gpus: Sequence[str] = (),
) -> int:
    """Run the job on this machine through one guard; returns the guard's exit code. The job is recorded in
    the job index first, so that `mopd-logs summarize local-N` finds its run dir as it does a Slurm job's."""
    from mopd_hpc.launch.local import local_job_id, run_local
    from mopd_hpc.launch.rankmap import probe_report_table, read_probe_reports

    run_dir, job_id = claimed.run_dir, local_job_id()
    record_in_job_index(job_id, run_dir, plan.name, config_path, environ, err)
    rc = run_local(
        plan, run_dir, python=python, environ=environ, out=out, job_id=job_id, gpus=gpus, lock=claimed.lock
    )
    if plan.probe:
        console.print(probe_report_table(read_probe_reports(run_dir.root)))  # type: ignore[attr-defined]
    print(f"[local] done: exit code {rc}; run dir {run_dir.root}", file=out)
    return rc


def submit_to_slurm(
    cfg: RunConfig,
    plan: JobPlan,
    request: SbatchRequest,
    run_dir: RunDir,
    config_path: str,
    *,
    out: TextIO,
    err: TextIO,
    environ: Mapping[str, str],
    python: str,
) -> int:
    """sbatch the job, record it in the job index and print the commands that follow it; returns 0, or
    EXIT_SUBMIT_FAILED (the reason on `err`) when sbatch refused it or could not be run."""
    from mopd_hpc.launch.slurm import SubmitError, submit

    try:
        job = submit(request, environ)
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
    """Record the job in the job index (logs/index.py), so that `mopd-logs summarize JOB_ID` finds its run
    dir; an index that cannot be written is a warning on `err`, not an error (the job runs regardless)."""
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
