"""What the run-dir lock (runtime/run_lock.py) tells the summary: whether a local job still runs, and whom the
lock turned away while a job held the run dir.

`lock_released(root, job_id)`: a local job (`local-N`) whose `mopd-submit --local` and guard hold the lock
for the job's life no longer holds it, so every process of it is gone; a guard of it that logged no end
(neither `guard_stop` nor its keeper's `guard_exit`) died. `refusals_of(root, job_id)`: the refusals
recorded in `events/refused.jsonl` while `job_id` held the lock. `starting_holder(root)`: the job that holds
the lock of a run dir where nothing ran yet (a first `mopd-submit --local` builds the tiny models before its
guard starts), named for the "nothing ran" message.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from mopd_hpc.logs.index import LOCAL_JOB_ID
from mopd_hpc.logs.jobs import leader_of
from mopd_hpc.runtime.run_lock import holder_of, read_holder, read_refusals

#: One refusal: (the refused job's id, None for a submission; host; pid; Unix time).
Refusal = tuple[str | None, str | None, int | None, float | None]


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def lock_released(root: Path, job_id: str | None) -> bool:
    """A local job (`local-N`) that no longer holds the run-dir lock: every process of it is gone (its
    mopd-submit and its guard hold the lock for the job's life, runtime/run_lock.py). False for a Slurm job
    (other nodes' guards outlive the first one's lock) and for a run dir whose lock file holds no record (an
    older run, or a file system without flock: `run_lock.acquire` writes the record only once it holds the
    lock)."""
    if job_id is None or not LOCAL_JOB_ID.match(job_id) or not read_holder(root):
        return False  # no record: no lock was ever taken here (an older run, a file system without flock)
    holder = holder_of(root)
    return holder is None or holder.get("job_id") != job_id


def refusals_of(root: Path, job_id: str | None) -> tuple[Refusal, ...]:
    """The refusals recorded while job `job_id` held the run-dir lock (`JobInfo.refused`)."""
    if job_id is None:
        return ()
    out = []
    for r in read_refusals(root):
        holder = r["holder"].get("job_id")
        if holder is None or leader_of(str(holder)) != leader_of(job_id):
            continue
        pid, ts = r.get("pid"), r.get("ts")
        out.append(
            (
                None if r.get("job_id") is None else str(r["job_id"]),
                None if r.get("host") is None else str(r["host"]),
                _int(pid),
                float(ts) if isinstance(ts, int | float) and not isinstance(ts, bool) else None,
            )
        )
    return tuple(out)


def starting_holder(root: Path) -> str | None:
    """Who holds `root`'s run-dir lock, as one clause for a run dir where nothing ran yet ("job local-42
    (host h, pid 42) holds it since 2026-12-02 03:46:49 UTC"), or None when no job holds it. A local job
    holds the lock from its `mopd-submit --local` on, before its guard writes anything (the tiny models are
    built first, on first use)."""
    holder = holder_of(root)
    if holder is None:
        return None
    since = holder.get("since")
    at = (
        dt.datetime.fromtimestamp(since, tz=dt.UTC).strftime(" since %Y-%m-%d %H:%M:%S UTC")
        if isinstance(since, int | float) and not isinstance(since, bool)
        else ""
    )
    return (
        f"job {holder.get('job_id')} (host {holder.get('host')}, pid {_int(holder.get('pid'))}) holds it{at}"
    )
