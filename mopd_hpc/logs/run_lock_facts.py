"""What the run-dir lock (runtime/run_lock.py) tells the summary: whether a local job still runs, and whom the
lock turned away while a job held the run dir.

`lock_released(root, job_id)`: a local job (`local-N`) whose `mopd-submit --local` and guard hold the lock
for the job's life no longer holds it, so every process of it is gone; a guard of it that logged no end
(neither `guard_stop` nor its keeper's `guard_exit`) died. `refusals_of(root, job_id)`: the refusals
recorded in `events/refused.jsonl` while `job_id` held the lock.
"""

from __future__ import annotations

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
