"""`summarize_run(run_dir)`: every fact `mopd-logs summarize` shows, as one frozen record (`RunSummary`).

The summary is of ONE job: the job id asked for, else the latest job of the run dir (the batch shell's
`state/job.json`, else the guard that started last). A run dir is reused on resume, resubmission and requeue;
events, state files and logs of other job ids, and of earlier incarnations of a requeued job, never count as
this job's failure (`mopd_hpc.logs.jobs`); other jobs are listed by id with their state.

Sources, each optional: the guards' event logs, the child logs (streamed by `scan`), the batch shell's
`state/*.json`, `metrics.jsonl` / `eval.json`, and sacct (when the job id is a Slurm id and sacct answers).
What of them could not be read is named, never a traceback (`unreadable`: logs/unreadable.py).
`RunSummary.to_dict()` is the `--json` output; its schema is documented in docs/en/logs.md and versioned by
`SCHEMA_VERSION` (bump it when a key changes meaning or disappears; adding keys keeps the version).

Modules: this one reads the run dir and decides (`summarize_run`); the records are `summary_records`, the job's
choice and state `job_state`, the first failure `failure`.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from mopd_hpc.logs.failure import find_first_failure
from mopd_hpc.logs.index import LOCAL_JOB_ID
from mopd_hpc.logs.job_state import (
    NUMERIC_JOB,
    is_int,
    job_end,
    job_state,
    other_jobs,
    query_job,
    read_json_record,
    target_job,
)
from mopd_hpc.logs.jobs import leader_of, record_belongs, select_job
from mopd_hpc.logs.next_steps import next_steps
from mopd_hpc.logs.progress import read_progress
from mopd_hpc.logs.run_events import ChildRun, read_run_segments
from mopd_hpc.logs.run_lock_facts import lock_released, refusals_of, starting_holder
from mopd_hpc.logs.sacct import SacctRunner, run_sacct
from mopd_hpc.logs.summary_records import CHECKPOINTED, SCHEMA_VERSION, ChildSlot, JobInfo, RunSummary
from mopd_hpc.logs.unreadable import unreadable_files
from mopd_hpc.records.run_dir import EVENTS_DIR, JOB_FILE, LOGS_DIR, METRICS_FILE, STATE_DIR
from mopd_hpc.records.unverified import read_unverified
from mopd_hpc.runtime.jobids import fold_job_id

__all__ = [
    "CHECKPOINTED",
    "OTHER_JOBS_ASKED",
    "SCHEMA_VERSION",
    "ChildSlot",
    "JobInfo",
    "NothingRanError",
    "RunDirMissingError",
    "RunSummary",
    "no_sacct",
    "summarize_run",
]

#: At most this many other jobs of the run dir (the latest) are looked up in sacct for their state.
OTHER_JOBS_ASKED = 3


class RunDirMissingError(ValueError):
    """The run directory does not exist or holds none of the files a run writes."""


class NothingRanError(RunDirMissingError):
    """The run directory exists but nothing ran there (yet): no guard events, child or job logs, state files
    or metrics, and sacct knows no such job. The CLI treats it like a missing run dir (exit 2)."""


def _nothing_ran(root: Path) -> bool:
    """True when `root` holds none of the files a started run writes (guard events, `logs/**` files,
    `state/*.json`, `metrics.jsonl`); a config or an empty skeleton from `mopd-submit` does not count."""
    if (root / METRICS_FILE).is_file() or any((root / STATE_DIR).glob("*.json")):
        return False
    if any((root / EVENTS_DIR).glob("*.jsonl")):
        return False
    logs = root / LOGS_DIR
    return not (logs.is_dir() and any(p.is_file() for p in logs.rglob("*")))


def no_sacct(argv: Sequence[str]) -> str:
    """A sacct runner for machines without Slurm accounting (and for tests): always fails."""
    raise OSError(f"sacct disabled: {' '.join(argv)}")


def _slots(children: Sequence[ChildRun]) -> tuple[ChildSlot, ...]:
    groups: dict[tuple[str, str, int], list[ChildRun]] = {}
    for c in children:
        groups.setdefault((c.host, c.role, c.index), []).append(c)
    return tuple(
        ChildSlot(h, r, i, tuple(sorted(gens, key=lambda g: g.generation)))
        for (h, r, i), gens in sorted(groups.items())
    )


def summarize_run(
    run_dir: str | os.PathLike[str], sacct_runner: SacctRunner | None = None, job_id: str | None = None
) -> RunSummary:
    """Read everything under `run_dir` (streamed) and decide the job state and first failure of one job.

    Args:
        sacct_runner: runs a sacct argv and returns stdout; None uses the real `sacct` when it is on PATH,
            `no_sacct` to skip Slurm accounting.
        job_id: the job to describe (any form: `123`, `123+1`, `local-42`); None: the run dir's latest job.
    Raises:
        RunDirMissingError: `run_dir` is not a directory.
        NothingRanError: nothing ran in `run_dir` (`_nothing_ran`) and sacct does not know the job.
    """
    root = Path(run_dir).expanduser().absolute()
    if not root.is_dir():
        raise RunDirMissingError(f"run dir {root} does not exist or is not a directory")
    segments = read_run_segments(root)
    job_json = read_json_record(root / JOB_FILE) or {}
    target = leader_of(job_id) if job_id is not None else target_job(root, job_json, segments)
    events = select_job(segments, target)
    guards, children = list(events.guards), list(events.children)
    job_id = events.job_id if events.job_id is not None else target
    if job_id is not None and not record_belongs(job_json, job_id, None):
        job_json = {}  # the batch shell's record of another job
    runner = sacct_runner if sacct_runner is not None else (run_sacct if shutil.which("sacct") else no_sacct)
    sacct = query_job(job_id, runner)
    if not segments and (sacct is None or not sacct.components) and _nothing_ran(root):
        holder = starting_holder(root)
        raise NothingRanError(
            f"nothing ran in {root}: no guard events, no child or job logs, no state files, no metrics"
            + (f", and sacct does not know job {job_id}" if job_id else "")
            + (
                f"; {holder} and has not started its guard yet (a first `mopd-submit --local` builds the "
                "tiny models before it: minutes); run this again once its guard has started"
                if holder
                else " (the job never started, or this is not the run dir)"
            )
        )
    restarts = [r for r in (job_json.get("restart_count"), events.incarnations - 1) if is_int(r) and r >= 0]
    restarts += [sacct.requeues] if sacct is not None and sacct.components else []
    restart = max(restarts) if restarts else None
    slots = _slots(children)
    released = lock_released(root, job_id)
    failure = find_first_failure(
        root,
        guards,
        children,
        sacct,
        {},
        job_id=job_id,
        restart=restart,
        logs_fallback=not segments or bool(children),
        lock_released=released,
    )
    local = job_id is not None and LOCAL_JOB_ID.match(job_id) is not None
    state, source = job_state(sacct, guards, slots, failure, local, released)
    if state not in ("RUNNING", "PENDING"):
        slots = tuple(replace(slot, job_over=True) for slot in slots)
    end_reason, end_step = job_end(root, job_id)
    if state == "SUCCEEDED" and end_reason == "checkpoint_signal":
        state = CHECKPOINTED
    restart_count = restart or 0
    name = sacct.components[0].name if sacct and sacct.components else None
    job = JobInfo(
        job_id=fold_job_id(job_id) if job_id and NUMERIC_JOB.match(job_id) else job_id,
        name=name,
        shape=job_json.get("shape") if isinstance(job_json.get("shape"), str) else None,
        components=tuple(str(c) for c in job_json.get("components", []) if isinstance(c, str)),
        restart_count=restart_count,
        requeues=sacct.requeues if sacct else restart_count,
        state=state,
        state_source=source,
        sacct=sacct,
        end_reason=end_reason,
        end_step=end_step,
        earlier_jobs=other_jobs(events.earlier, runner, OTHER_JOBS_ASKED),
        later_jobs=other_jobs(events.later, runner, OTHER_JOBS_ASKED),
        refused=refusals_of(root, job_id),
        unverified=read_unverified(root),
    )
    progress = read_progress(root)
    running = state == "RUNNING"
    steps = next_steps(
        str(root),
        failure.cause.key if failure else ("checkpoint_signal" if state == CHECKPOINTED else None),
        job.job_id,
        (failure.host if failure else None) or (slots[0].host if slots else None),
        failure.role if failure else None,
        failure.index if failure else None,
        running,
    )
    return RunSummary(
        run_dir=str(root),
        job=job,
        guards=tuple(guards),
        children=slots,
        first_failure=failure,
        progress=progress,
        next_steps=tuple(steps),
        unreadable=unreadable_files(root),
    )
