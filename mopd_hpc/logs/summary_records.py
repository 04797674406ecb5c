"""The frozen records `mopd-logs summarize` shows (`summary.summarize_run` builds them): `ChildSlot` (one child
with all its generations), `JobInfo` (the job and its state), `RunSummary` (everything about one run; its
`to_dict()` is the `--json` output, schema in docs/en/logs.md, versioned by `SCHEMA_VERSION`)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from mopd_hpc.logs.failure_record import FirstFailure
from mopd_hpc.logs.progress import Progress
from mopd_hpc.logs.run_events import ChildRun, GuardRun
from mopd_hpc.logs.run_lock_facts import Refusal
from mopd_hpc.logs.sacct import SacctJob
from mopd_hpc.logs.unreadable import Unreadable

#: The state of a run that stopped cleanly on a checkpoint signal (resumable); see `JobInfo`.
CHECKPOINTED = "CHECKPOINTED"
#: Version of the --json schema (docs/en/logs.md); bump it when a key changes meaning or disappears.
SCHEMA_VERSION = 1


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
    (runtime/run_lock.py `read_refusals`). `unverified`: what the run was let to do unverified
    (`allow_unverified: true`: code not yet run on GPUs here), as mopd-submit recorded it
    (records/unverified.py).
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
    unverified: tuple[str, ...] = ()

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
            "unverified": list(self.unverified),
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
    #: What could not be read (logs/unreadable.py): skipped lines and records, named.
    unreadable: tuple[Unreadable, ...] = ()

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
            "unreadable": [u.to_dict() for u in self.unreadable],
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
