"""Which job a summary describes and in which state it is: the run dir's latest job (`target_job`), sacct's
record (`query_job`), the state from sacct or the run dir (`job_state`), the actor's end-of-job marker
(`job_end`), and the states of the other jobs that used the run dir (`other_jobs`)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mopd_hpc.logs.causes import INTERRUPTED, TERMINATED
from mopd_hpc.logs.failure_record import FirstFailure
from mopd_hpc.logs.jobs import Segment, latest_job_id, leader_of
from mopd_hpc.logs.run_events import GuardRun
from mopd_hpc.logs.sacct import SacctJob, SacctRunner, query_sacct
from mopd_hpc.logs.summary_records import ChildSlot
from mopd_hpc.records.run_dir import JOB_END_FILE, JOB_FILE
from mopd_hpc.runtime.jobids import JobIdError, fold_job_id

#: A Slurm job id (a het job's `123+1` too): only these are looked up in sacct.
NUMERIC_JOB = re.compile(r"^[0-9]+(\+[0-9]+)?$")


def read_json_record(path: Path) -> dict[str, Any] | None:
    """The JSON object at `path`, or None when it is missing, unreadable, malformed or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def sacct_state(sacct: SacctJob) -> str:
    """One state for a job from its sacct components: RUNNING, PENDING, FAILED, CANCELLED, UNKNOWN (the
    first any component is in), else SUCCEEDED."""
    states = [c.coarse_state for c in sacct.components]
    for verdict in ("RUNNING", "PENDING", "FAILED", "CANCELLED", "UNKNOWN"):
        if verdict in states:
            return verdict
    return "SUCCEEDED"


def job_state(
    sacct: SacctJob | None,
    guards: Sequence[GuardRun],
    slots: tuple[ChildSlot, ...],
    failure: FirstFailure | None,
    local: bool = False,
    lock_released: bool = False,
) -> tuple[str, str]:
    """(state, source) of the job (`summary_records.JobInfo.state`): sacct's when it has components, else
    from the run dir ("run_dir"): RUNNING while a guard has not ended (and nothing failed, the lock is
    held), CANCELLED for a person's stop, FAILED with a first failure, SUCCEEDED, UNKNOWN without events."""
    failed = failure is not None
    if sacct is not None and sacct.components:
        states = [c.coarse_state for c in sacct.components]
        for verdict in ("RUNNING", "PENDING"):
            if verdict in states:
                return verdict, "sacct"
        for verdict in ("FAILED", "CANCELLED", "UNKNOWN"):
            if verdict in states:
                return verdict, "sacct"
        return "SUCCEEDED", "sacct"
    if not guards and not slots:
        return ("FAILED" if failed else "UNKNOWN"), "run_dir"
    if any(not g.ended for g in guards) and not failed and not lock_released:
        return "RUNNING", "run_dir"
    if failure is not None and failure.source == "slurm_signal":
        key = failure.cause.key
        if key == INTERRUPTED or (local and key == TERMINATED):  # a person stopped it
            return "CANCELLED", "run_dir"
    return ("FAILED" if failed else "SUCCEEDED"), "run_dir"


def job_end(root: Path, job_id: str | None) -> tuple[str | None, int | None]:
    """(reason, step) of the actor's end-of-job marker; (None, None) when absent, malformed, or written by
    another job than `job_id` (when both ids are known)."""
    record = read_json_record(root / JOB_END_FILE)
    if record is None or not isinstance(record.get("reason"), str):
        return None, None
    marker_job = record.get("job_id")
    if job_id is not None and marker_job is not None and leader_of(str(marker_job)) != leader_of(job_id):
        return None, None
    step = record.get("step")
    return record["reason"], step if isinstance(step, int) and not isinstance(step, bool) else None


def is_int(value: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def query_job(job_id: str | None, runner: SacctRunner) -> SacctJob | None:
    """sacct's record of a Slurm job id (`123`, `123+1`), through `runner`; None for another id (local)."""
    if not job_id or not NUMERIC_JOB.match(job_id):
        return None
    try:
        return query_sacct(fold_job_id(job_id), runner)
    except JobIdError:
        return None


def target_job(root: Path, job_json: dict[str, Any], segments: Sequence[Segment]) -> str | None:
    """The latest job of the run dir: `state/job.json`'s, unless a guard of another job started after the
    batch shell wrote it (a local run after a Slurm one), else the guard that started last."""
    from_events = latest_job_id(segments)
    if job_json.get("job_id") is None:
        return from_events
    from_json = leader_of(str(job_json["job_id"]))
    if from_events is None or from_events == from_json:
        return from_json
    try:
        written = (root / JOB_FILE).stat().st_mtime
    except OSError:
        return from_json
    started = max((g.start_ts or 0.0) for g, _ in segments if leader_of(g.job_id) == from_events)
    return from_events if started > written else from_json


def other_jobs(
    others: Sequence[tuple[str, str]], runner: SacctRunner, asked: int
) -> tuple[tuple[str, str], ...]:
    """(job id, state): sacct's state for the `asked` nearest (last) ones when it answers, else the verdict."""
    out = []
    for n, (job_id, verdict) in enumerate(others):
        sacct = query_job(job_id, runner) if n >= len(others) - asked else None
        out.append((job_id, sacct_state(sacct) if sacct is not None and sacct.components else verdict))
    return tuple(out)
