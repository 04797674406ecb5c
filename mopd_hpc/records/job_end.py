"""The end of a job, as the actor announces it to the servers of the job (teachers, rollout engines).

Teacher and rollout servers serve until told to stop; the guard ends a node only when every child of the
plan has exited (runtime/guard/autostart.py). So when training is over (or the actor checkpointed on
SIGUSR2), the actor writes `run_dir/state/job_end.json` {job_id, reason, step, ts} atomically, and every
server of the same job stops cleanly and exits 0. A marker counts only when it names the server's job
(MOPD_JOB_ID) and was written after the server started: a marker left by an earlier job in the same run
directory, or by the same Slurm job before it was requeued (same job id), is ignored. The actor writes it only
after every server answered, so a live server always started before it. The run directory is shared by every node of a Slurm job, so this works
across het groups without the guard's token.

A requeued Slurm job keeps its job id, so the marker its previous run wrote on SIGUSR2 names the same job:
a server ignores a marker written before it started watching (its `ts` older than the watch start minus
`CLOCK_SKEW_S`, the clock difference allowed between nodes). The actor announces the end only after every
server published its endpoint, so a marker of the current run is never older than its servers' watch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

from mopd_hpc.atomic import atomic_write_json
from mopd_hpc.records.run_dir import JOB_END_FILE

log = logging.getLogger("mopd_hpc.trainer")

#: How often a server looks for the marker, in seconds.
POLL_S = 0.25
#: Clock difference allowed between the actor's node and a server's node, in seconds (a requeue takes
#: longer: Slurm holds a requeued job for at least its credential lifetime).
CLOCK_SKEW_S = 5.0
#: Reasons the actor gives.
REASONS = ("finished", "checkpoint_signal", "failed")


def read_job_end(run_dir: Path) -> dict[str, Any] | None:
    """The actor's end-of-job record (`state/job_end.json`), or None when absent or unreadable."""
    try:
        return json.loads((run_dir / JOB_END_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def write_job_end(run_dir: Path, job_id: str, reason: str, step: int) -> Path:
    """Announce the end of job `job_id` (atomic). Raises ValueError for an unknown reason."""
    if reason not in REASONS:
        raise ValueError(f"reason={reason!r}: expected one of {REASONS}")
    path = run_dir / JOB_END_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"job_id": job_id, "reason": reason, "step": step, "ts": time.time()})
    return path


def job_ended(run_dir: Path, job_id: str, since: float | None = None) -> bool:
    """True when the marker names this job and, with `since` (Unix seconds), was written no earlier than
    `since - CLOCK_SKEW_S` (a marker without a numeric `ts` counts)."""
    record = read_job_end(run_dir)
    if record is None or record.get("job_id") != job_id:
        return False
    ts = record.get("ts")
    return since is None or not isinstance(ts, int | float) or ts >= since - CLOCK_SKEW_S


async def stop_on_job_end(
    run_dir: Path, job_id: str, stop: asyncio.Event, poll_s: float = POLL_S, since: float | None = None
) -> None:
    """Set `stop` once the actor announced the end of `job_id` (returns then, or when `stop` is set).

    A marker older than `since` (default: now, the start of the watch) is an earlier run's of the same
    job (a requeue) and is ignored (module docstring).
    """
    since = time.time() if since is None else since
    while not stop.is_set():
        if job_ended(run_dir, job_id, since):
            log.info("job %s ended (%s): stopping", job_id, run_dir / JOB_END_FILE)
            stop.set()
            return
        try:
            await asyncio.wait_for(stop.wait(), timeout=poll_s)
        except TimeoutError:
            pass
