"""`summarize_run(run_dir)`: every fact `mopd-logs summarize` shows, as one frozen record (`RunSummary`).

The summary is of ONE job: the job id asked for, else the latest job of the run dir (the batch shell's
`state/job.json`, else the guard that started last). A run dir is reused on resume, resubmission and requeue;
events, state files and logs of other job ids, and of earlier incarnations of a requeued job, never count as
this job's failure (`mopd_hpc.logs.jobs`); other jobs are listed by id with their state.

Sources, each optional: the guards' event logs, the child logs (streamed by `scan`), the batch shell's
`state/*.json`, `metrics.jsonl` / `eval.json`, and sacct (when the job id is a Slurm id and sacct answers).
`RunSummary.to_dict()` is the `--json` output; its schema is documented in docs/en/logs.md and versioned by
`SCHEMA_VERSION` (bump it when a key changes meaning or disappears; adding keys keeps the version).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mopd_hpc.logs.causes import INTERRUPTED, TERMINATED
from mopd_hpc.logs.failure import FirstFailure, find_first_failure
from mopd_hpc.logs.index import LOCAL_JOB_ID
from mopd_hpc.logs.jobs import Segment, latest_job_id, leader_of, record_belongs, select_job
from mopd_hpc.logs.next_steps import next_steps
from mopd_hpc.logs.progress import Progress, read_progress
from mopd_hpc.logs.run_events import ChildRun, GuardRun, read_run_segments
from mopd_hpc.logs.run_lock_facts import Refusal, lock_released, refusals_of
from mopd_hpc.logs.sacct import SacctJob, SacctRunner, query_sacct, run_sacct
from mopd_hpc.records.run_dir import EVENTS_DIR, JOB_END_FILE, JOB_FILE, LOGS_DIR, METRICS_FILE, STATE_DIR
from mopd_hpc.runtime.jobids import JobIdError, fold_job_id

#: The state of a run that stopped cleanly on a checkpoint signal (resumable); see `JobInfo`.
CHECKPOINTED = "CHECKPOINTED"
#: Version of the --json schema (docs/en/logs.md).
SCHEMA_VERSION = 1
#: At most this many other jobs of the run dir (the latest) are looked up in sacct for their state.
OTHER_JOBS_ASKED = 3
_NUMERIC_JOB = re.compile(r"^[0-9]+(\+[0-9]+)?$")


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


@dataclass(frozen=True, slots=True)
class ChildSlot:
    """One (host, role, index) with all its generations. `restarts` = generations − 1; `state` is
    "running", "exited", "killed" (by the guard: teardown), "failed", or "stopped" (no exit event, but its
    guard was done with it — `plan_done`/`guard_stop` — or the job is over: `job_over`) for the latest
    generation."""

    host: str
    role: str
    index: int
    generations: tuple[ChildRun, ...]
    job_over: bool = False

    @property
    def latest(self) -> ChildRun:
        return self.generations[-1]

    @property
    def restarts(self) -> int:
        return len(self.generations) - 1

    @property
    def state(self) -> str:
        c = self.latest
        if c.exit_ts is None:
            return "stopped" if c.guard_done_ts is not None or self.job_over else "running"
        if c.teardown:
            return "killed"
        return "failed" if c.failed else "exited"

    def to_dict(self) -> dict[str, Any]:
        c = self.latest
        return {
            "host": self.host,
            "role": self.role,
            "index": self.index,
            "state": self.state,
            "exit_code": c.exit_code,
            "signal": c.signal,
            "restarts": self.restarts,
            "generations": [g.to_dict() for g in self.generations],
        }


@dataclass(frozen=True, slots=True)
class JobInfo:
    """The job: id (leader), name, shape, component names, restart count, overall state and its source.

    `state` is one of RUNNING, PENDING, FAILED, CANCELLED, UNKNOWN, SUCCEEDED, or CHECKPOINTED: every part
    ended cleanly because the actor checkpointed on a checkpoint signal (SIGUSR2) and stopped at step
    `end_step`; re-running the same command resumes it. Without sacct, a job stopped by Ctrl-C, or a local
    job stopped by any signal (SIGTERM to `mopd-submit --local`), is CANCELLED; a job whose guard died is
    FAILED, never RUNNING (the keeper's `guard_exit`, or for a local job a run-dir lock it no longer holds). `end_reason`/`end_step` are the actor's
    `state/job_end.json` ("finished", "checkpoint_signal", "failed"), None when it wrote none.
    `restart_count` is the incarnation shown (SLURM_RESTART_COUNT: a requeued job's earlier incarnations are
    not part of the summary). `earlier_jobs`/`later_jobs`: (job id, state) of the other jobs that used the
    run dir (state from sacct when it answers, else `jobs.events_verdict`). `refused`: (job id or None for
    a submission, host, pid, Unix time) of each job the run-dir lock turned away while this job held it
    (runtime/run_lock.py `read_refusals`).
    """

    job_id: str | None
    name: str | None
    shape: str | None
    components: tuple[str, ...]
    restart_count: int
    requeues: int
    state: str
    state_source: str
    sacct: SacctJob | None
    end_reason: str | None = None
    end_step: int | None = None
    earlier_jobs: tuple[tuple[str, str], ...] = ()
    later_jobs: tuple[tuple[str, str], ...] = ()
    refused: tuple[Refusal, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "name": self.name,
            "shape": self.shape,
            "components": list(self.components),
            "restart_count": self.restart_count,
            "requeues": self.requeues,
            "state": self.state,
            "state_source": self.state_source,
            "sacct": self.sacct.to_dict() if self.sacct else None,
            "end": None if self.end_reason is None else {"reason": self.end_reason, "step": self.end_step},
            "earlier_jobs": [{"job_id": j, "state": st} for j, st in self.earlier_jobs],
            "later_jobs": [{"job_id": j, "state": st} for j, st in self.later_jobs],
            "refused": [{"job_id": j, "host": h, "pid": p, "ts": ts} for j, h, p, ts in self.refused],
        }


@dataclass(frozen=True, slots=True)
class RunSummary:
    """Everything about one run (see module docstring). Build with `summarize_run`."""

    run_dir: str
    job: JobInfo
    guards: tuple[GuardRun, ...]
    children: tuple[ChildSlot, ...]
    first_failure: FirstFailure | None
    progress: Progress
    next_steps: tuple[str, ...]

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys([g.host for g in self.guards] + [c.host for c in self.children]))

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "run_dir": self.run_dir,
            "job": self.job.to_dict(),
            "nodes": [
                {
                    "host": host,
                    "guard": next((g.to_dict() for g in self.guards if g.host == host), None),
                    "children": [c.to_dict() for c in self.children if c.host == host],
                }
                for host in self.hosts
            ],
            "first_failure": self.first_failure.to_dict() if self.first_failure else None,
            "progress": self.progress.to_dict(),
            "next_steps": list(self.next_steps),
        }

    def to_json(self) -> str:
        """`to_dict()` as strict JSON (NaN and infinities become null)."""
        return json.dumps(_finite(self.to_dict()), indent=2, allow_nan=False)


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _slots(children: Sequence[ChildRun]) -> tuple[ChildSlot, ...]:
    groups: dict[tuple[str, str, int], list[ChildRun]] = {}
    for c in children:
        groups.setdefault((c.host, c.role, c.index), []).append(c)
    return tuple(
        ChildSlot(h, r, i, tuple(sorted(gens, key=lambda g: g.generation)))
        for (h, r, i), gens in sorted(groups.items())
    )


def _sacct_state(sacct: SacctJob) -> str:
    states = [c.coarse_state for c in sacct.components]
    for verdict in ("RUNNING", "PENDING", "FAILED", "CANCELLED", "UNKNOWN"):
        if verdict in states:
            return verdict
    return "SUCCEEDED"


def _job_state(
    sacct: SacctJob | None,
    guards: Sequence[GuardRun],
    slots: tuple[ChildSlot, ...],
    failure: FirstFailure | None,
    local: bool = False,
    lock_released: bool = False,
) -> tuple[str, str]:
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


def _job_end(root: Path, job_id: str | None) -> tuple[str | None, int | None]:
    """(reason, step) of the actor's end-of-job marker; (None, None) when absent, malformed, or written by
    another job than `job_id` (when both ids are known)."""
    record = _read_json(root / JOB_END_FILE)
    if record is None or not isinstance(record.get("reason"), str):
        return None, None
    marker_job = record.get("job_id")
    if job_id is not None and marker_job is not None and leader_of(str(marker_job)) != leader_of(job_id):
        return None, None
    step = record.get("step")
    return record["reason"], step if isinstance(step, int) and not isinstance(step, bool) else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _query(job_id: str | None, runner: SacctRunner) -> SacctJob | None:
    if not job_id or not _NUMERIC_JOB.match(job_id):
        return None
    try:
        return query_sacct(fold_job_id(job_id), runner)
    except JobIdError:
        return None


def _target_job(root: Path, job_json: dict[str, Any], segments: Sequence[Segment]) -> str | None:
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


def _other_jobs(
    others: Sequence[tuple[str, str]], runner: SacctRunner, asked: int
) -> tuple[tuple[str, str], ...]:
    """(job id, state): sacct's state for the `asked` nearest (last) ones when it answers, else the verdict."""
    out = []
    for n, (job_id, verdict) in enumerate(others):
        sacct = _query(job_id, runner) if n >= len(others) - asked else None
        out.append((job_id, _sacct_state(sacct) if sacct is not None and sacct.components else verdict))
    return tuple(out)


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
    job_json = _read_json(root / JOB_FILE) or {}
    target = leader_of(job_id) if job_id is not None else _target_job(root, job_json, segments)
    events = select_job(segments, target)
    guards, children = list(events.guards), list(events.children)
    job_id = events.job_id if events.job_id is not None else target
    if job_id is not None and not record_belongs(job_json, job_id, None):
        job_json = {}  # the batch shell's record of another job
    runner = sacct_runner if sacct_runner is not None else (run_sacct if shutil.which("sacct") else no_sacct)
    sacct = _query(job_id, runner)
    if not segments and (sacct is None or not sacct.components) and _nothing_ran(root):
        raise NothingRanError(
            f"nothing ran in {root}: no guard events, no child or job logs, no state files, no metrics"
            + (f", and sacct does not know job {job_id}" if job_id else "")
            + " (the job never started, or this is not the run dir)"
        )
    restarts = [r for r in (job_json.get("restart_count"), events.incarnations - 1) if _is_int(r) and r >= 0]
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
    state, source = _job_state(sacct, guards, slots, failure, local, released)
    if state not in ("RUNNING", "PENDING"):
        slots = tuple(replace(slot, job_over=True) for slot in slots)
    end_reason, end_step = _job_end(root, job_id)
    if state == "SUCCEEDED" and end_reason == "checkpoint_signal":
        state = CHECKPOINTED
    restart_count = restart or 0
    name = sacct.components[0].name if sacct and sacct.components else None
    job = JobInfo(
        job_id=fold_job_id(job_id) if job_id and _NUMERIC_JOB.match(job_id) else job_id,
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
        earlier_jobs=_other_jobs(events.earlier, runner, OTHER_JOBS_ASKED),
        later_jobs=_other_jobs(events.later, runner, OTHER_JOBS_ASKED),
        refused=refusals_of(root, job_id),
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
    )
