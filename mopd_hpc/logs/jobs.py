"""One job out of a reused run directory: which guard processes, children and state files are *this* job's.

A run directory is reused on resume, resubmission and Slurm requeue: every job appends its guards' events to
`events/<host>.guard.jsonl` and overwrites `state/*.json`. `select_job(segments, job_id)` keeps the guard
processes (`run_events.read_run_segments`) of one job id (het "+N" folded) and, of a requeued job, only the
latest incarnation: Slurm ends every step of an incarnation before the next starts, so guard processes whose
lifetimes (`guard_start` … last event) overlap belong to one incarnation, and a gap separates incarnations.
Everything else is an earlier (or later) job, reported by id with a one-word verdict, never as a failure.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mopd_hpc.logs.run_events import ChildRun, GuardRun
from mopd_hpc.records.run_dir import LOGS_DIR
from mopd_hpc.runtime.jobids import JobIdError, fold_job_id

Segment = tuple[GuardRun, list[ChildRun]]
#: The batch shell's log (`--output=.../batch.%j.log`) and a step's (`<component>.r<restart>.t<task>.log`).
_BATCH_LOG_RE = re.compile(r"^batch\.(?P<job>[0-9]+(?:\+[0-9]+)?)\.log$")
_STEP_LOG_RE = re.compile(r"^.+\.r(?P<restart>[0-9]+)\.t[0-9]+\.log$")


def leader_of(job_id: str | None) -> str | None:
    """`123+1` → `123`; a non-Slurm id (`local-42`) as is; None stays None."""
    if job_id is None:
        return None
    try:
        return fold_job_id(job_id)
    except JobIdError:
        return job_id


def record_belongs(record: Mapping[str, Any], job_id: str | None, restart: int | None) -> bool:
    """Whether a batch-shell state record (`job_id`, `restart_count` keys) is of job `job_id`, incarnation
    `restart`. A key the record (or the caller) lacks does not exclude it."""
    rec_job = record.get("job_id")
    if job_id is not None and rec_job is not None and leader_of(str(rec_job)) != leader_of(job_id):
        return False
    rec_restart = record.get("restart_count")
    if restart is not None and isinstance(rec_restart, int) and not isinstance(rec_restart, bool):
        return rec_restart == restart
    return True


@dataclass(frozen=True, slots=True)
class JobEvents:
    """The events of one job in a run directory.

    Attributes:
        job_id: the leader id selected (None when neither asked for nor found).
        guards, children: the guard processes and children of its latest incarnation.
        incarnations: how many incarnations of the job the events show (0 without events).
        earlier, later: (job id, verdict) of the other jobs whose events are in the directory and whose
            guards first started before (after) this job's, oldest first; verdict from `events_verdict`.
    """

    job_id: str | None
    guards: tuple[GuardRun, ...]
    children: tuple[ChildRun, ...]
    incarnations: int
    earlier: tuple[tuple[str, str], ...]
    later: tuple[tuple[str, str], ...] = ()


def _start(seg: Segment) -> float:
    g = seg[0]
    return g.start_ts if g.start_ts is not None else (g.last_ts or 0.0)


def _end(seg: Segment) -> float:
    g = seg[0]
    return max(x for x in (g.last_ts, g.start_ts, 0.0) if x is not None)


def incarnations_of(segments: Sequence[Segment]) -> list[list[Segment]]:
    """`segments` (one job's) grouped into incarnations, oldest first: a segment starting after every earlier
    segment has ended opens a new incarnation."""
    groups: list[list[Segment]] = []
    horizon = float("-inf")
    for seg in sorted(segments, key=_start):
        if not groups or _start(seg) > horizon:
            groups.append([])
        groups[-1].append(seg)
        horizon = max(horizon, _end(seg))
    return groups


def latest_job_id(segments: Sequence[Segment]) -> str | None:
    """The job id of the guard process that started last (None without events)."""
    known = [seg for seg in segments if seg[0].job_id is not None]
    return leader_of(max(known, key=_start)[0].job_id) if known else None


def events_verdict(guards: Sequence[GuardRun], children: Sequence[ChildRun]) -> str:
    """A one-word account of a job from its events: FAILED (a child failed on its own, or a guard died
    without a stop signal: its keeper's `guard_exit` without `guard_stop`), INTERRUPTED (SIGINT), SIGNALLED
    (SIGTERM/SIGUSR2: scancel, preemption or time limit; SIGTERM to a local run), ENDED (every guard
    stopped) or UNKNOWN."""
    if any(c.failed and c.exit_ts is not None and not c.teardown for c in children):
        return "FAILED"
    names = [name for g in guards for _, name in g.signals[:1]]
    if "SIGINT" in names:
        return "INTERRUPTED"
    if names:
        return "SIGNALLED"
    if any(g.died for g in guards):
        return "FAILED"
    if guards and all(g.stop_ts is not None for g in guards):
        return "ENDED"
    return "UNKNOWN"


def select_job(segments: Sequence[Segment], job_id: str | None) -> JobEvents:
    """The events of job `job_id` (any form; None: the job whose guard started last), see module docstring."""
    target = leader_of(job_id) if job_id is not None else latest_job_id(segments)
    by_job: dict[str, list[Segment]] = {}
    for seg in segments:
        key = leader_of(seg[0].job_id)
        if key is not None:
            by_job.setdefault(key, []).append(seg)
    if target is None:  # events without any job id (old logs): treat them all as one job
        mine = [seg for seg in segments if seg[0].job_id is None]
    else:
        mine = by_job.get(target, [])
    groups = incarnations_of(mine)
    latest = groups[-1] if groups else []
    latest.sort(key=lambda seg: (seg[0].host, _start(seg)))
    first = min((_start(seg) for seg in mine), default=float("inf"))
    earlier, later = [], []
    for key, segs in sorted(by_job.items(), key=lambda kv: min(_start(s) for s in kv[1])):
        if key == target:
            continue
        last = incarnations_of(segs)[-1]
        verdict = events_verdict([g for g, _ in last], [c for _, cs in last for c in cs])
        (earlier if min(_start(s) for s in segs) < first else later).append((key, verdict))
    return JobEvents(
        job_id=target,
        guards=tuple(g for g, _ in latest),
        children=tuple(c for _, cs in latest for c in cs),
        incarnations=len(groups),
        earlier=tuple(earlier),
        later=tuple(later),
    )


def job_log_paths(run_dir: Path, job_id: str | None, restart: int | None) -> list[Path]:
    """The batch and step logs (`logs/*.log`: Slurm's and srun's own lines) of job `job_id`, incarnation
    `restart` (None: any): another job's batch log (`batch.<id>.log`) and another incarnation's step logs
    (`<component>.r<restart>.t<task>.log`) are left out."""
    logs = run_dir / LOGS_DIR
    out = []
    for path in sorted(logs.glob("*.log")) if logs.is_dir() else []:
        batch, step = _BATCH_LOG_RE.match(path.name), _STEP_LOG_RE.match(path.name)
        if batch and job_id is not None and leader_of(batch["job"]) != leader_of(job_id):
            continue
        if step and restart is not None and int(step["restart"]) != restart:
            continue
        if path.is_file():
            out.append(path)
    return out
