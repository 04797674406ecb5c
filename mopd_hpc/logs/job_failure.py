"""The first failure of a job when no child of it failed (`failure` module docstring, steps 2 and 3).

Step 2, in order: Slurm's signal to the guards (time limit, preemption, requeue: sacct state,
`state/requeue.json`, slurmstepd lines; on a local run a stop signal sent to `mopd-submit --local`), a guard
that died, a guard gone with the run-dir lock released, a guard that never became ready, the batch shell's
`state/first_failure.json`, a failed sacct component, a guard that never stopped. Step 3, without guard
events: the child log with a traceback modified first. State files and job logs of another job id or an
earlier incarnation are left out (`jobs.record_belongs`, `jobs.job_log_paths`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mopd_hpc.logs.causes import (
    STEP_FAILED,
    UNKNOWN,
    Cause,
    cancelled_cause,
    classify_text,
    exception_cause,
    guard_death_cause,
    guard_gone_cause,
    guard_signal_cause,
)
from mopd_hpc.logs.failure_record import EVIDENCE_TAIL_LINES, FirstFailure
from mopd_hpc.logs.index import LOCAL_JOB_ID
from mopd_hpc.logs.jobs import job_log_paths, leader_of, record_belongs
from mopd_hpc.logs.run_events import ChildRun, GuardRun
from mopd_hpc.logs.sacct import SacctJob
from mopd_hpc.logs.scan import scan_log
from mopd_hpc.logs.signature import traceback_signature
from mopd_hpc.logs.tailing import CHILD_LOG_RE, read_last_lines
from mopd_hpc.records.run_dir import LOGS_DIR, STATE_DIR

#: Guard states / sacct states that name a cause by themselves.
SACCT_STATE_CAUSES: Mapping[str, tuple[str, str]] = {
    "TIMEOUT": ("time_limit", "time limit"),
    "PREEMPTED": ("preempted", "preempted/requeued"),
    "REQUEUED": ("preempted", "preempted/requeued"),
    "OUT_OF_MEMORY": ("host_oom", "host out of memory (OOM killer)"),
    "NODE_FAIL": ("node_fail", "node failure"),
}
#: A job or step id in slurmstepd's lines ("*** JOB 365 ON n1 ...", "*** STEP 365.0 ON n1 ...").
_SLURM_ID_RE = re.compile(r"\b(?:JOB|STEP) ([0-9]+)")


def _read_state(
    run_dir: Path, name: str, job_id: str | None = None, restart: int | None = None
) -> dict[str, Any] | None:
    """`state/<name>` when it is of job `job_id`, incarnation `restart` (`jobs.record_belongs`), else None."""
    try:
        data = json.loads((run_dir / STATE_DIR / name).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not record_belongs(data, job_id, restart):
        return None
    return data


def _job_text_cause(
    run_dir: Path, job_id: str | None, restart: int | None
) -> tuple[Cause | None, Path | None]:
    fallback: tuple[Cause, Path] | None = None
    for path in job_log_paths(run_dir, job_id, restart):
        try:
            scan = scan_log(path)
        except OSError:
            continue
        lines = scan.evidence_lines()
        if job_id is not None:  # slurmstepd names the job: "*** JOB 365 ON n1 CANCELLED ..."
            leader = leader_of(job_id)
            lines = [x for x in lines if all(m == leader for m in _SLURM_ID_RE.findall(x))]
        cause = classify_text(lines)
        if cause is not None and cause.key == "cancelled":  # a later log may say why (DUE TO TIME LIMIT)
            fallback = fallback or (cause, path)
        elif cause is not None:
            return cause, path
    return fallback or (None, None)


def job_level_failure(
    run_dir: Path,
    guards: Sequence[GuardRun],
    children: Sequence[ChildRun],
    sacct: SacctJob | None,
    job_id: str | None = None,
    restart: int | None = None,
    logs_fallback: bool = True,
    lock_released: bool = False,
) -> FirstFailure | None:
    """The failure of a job none of whose children failed (`failure` module docstring, steps 2 and 3), or
    None: Slurm's signal to a guard, a dead or unreachable guard, the batch shell's state, a failed sacct
    component; without children and with `logs_fallback`, the first child log with a traceback."""
    text_cause, text_path = _job_text_cause(run_dir, job_id, restart)
    local = job_id is not None and LOCAL_JOB_ID.match(job_id) is not None

    def make(cause: Cause, source: str, host: str | None = None, ts: float | None = None) -> FirstFailure:
        path = text_path if text_cause is not None and cause.key == text_cause.key else None
        tail = tuple(read_last_lines(path, EVIDENCE_TAIL_LINES)) if path else ()
        return FirstFailure(
            cause, source, host=host, ts=ts, log_path=str(path) if path else None, log_tail=tail
        )

    sacct_cause, states = None, [(c.component_id, c.state) for c in sacct.components] if sacct else []
    for comp_id, comp_state in states:
        state = comp_state.split()[0].rstrip("+") if comp_state else ""
        if state in SACCT_STATE_CAUSES:
            sacct_cause = Cause(*SACCT_STATE_CAUSES[state], f"sacct {comp_id} State={comp_state}")
            break
    cancelled = cancelled_cause(states, text_cause) if sacct_cause is None else None
    signalled = [g for g in guards if g.signals]
    if signalled:
        g = min(signalled, key=lambda x: x.first_signal_ts or 0.0)
        requeue = _read_state(run_dir, "requeue.json", job_id, restart)
        if text_cause is not None and text_cause.key in ("time_limit", "preempted"):
            cause = text_cause
        elif sacct_cause is not None:
            cause = sacct_cause
        elif requeue is not None:
            cause = Cause(
                "preempted", "preempted/requeued", f"state/requeue.json signal={requeue.get('signal')}"
            )
        elif cancelled is not None:
            cause = cancelled
        else:
            cause = guard_signal_cause(g.signals[0][1], local=local)
        return make(cause, "slurm_signal", host=g.host, ts=g.first_signal_ts)
    dead = sorted((g for g in guards if g.died), key=lambda x: x.exit_ts or 0.0)
    if dead:  # its children died with it (parent-death signal, the keeper's sweep): no exit of theirs
        g = dead[0]
        return make(guard_death_cause(g.exit_signal, g.exit_code), "guard", host=g.host, ts=g.exit_ts)
    if lock_released and (gone := [g for g in guards if not g.ended]):
        return make(guard_gone_cause(), "guard", host=gone[0].host, ts=gone[0].last_ts)
    for g in guards:
        if g.start_ts is not None and g.ready_ts is None:
            cause = text_cause or Cause(
                "guard_unreachable", "guard unreachable", "guard_start without guard_ready"
            )
            return make(cause, "guard", host=g.host, ts=g.start_ts)
    first = _read_state(run_dir, "first_failure.json", job_id, restart)
    if first is not None:
        cause = text_cause or Cause(
            STEP_FAILED,
            f"step of component {first.get('component')} exited with code {first.get('exit_code')}",
            json.dumps(first, sort_keys=True),
        )
        ts = first.get("time_unix")
        return make(cause, "batch_state", ts=float(ts) if isinstance(ts, int | float) else None)
    if sacct is not None:
        failed = [c for c in sacct.components if c.coarse_state in ("FAILED", "CANCELLED")]
        if sacct_cause is not None or failed:
            cause = (
                sacct_cause
                or cancelled
                or text_cause
                or Cause(
                    UNKNOWN, f"{failed[0].component_id} {failed[0].state}", f"ExitCode={failed[0].exit_code}"
                )
            )
            return make(cause, "sacct")
    stopped_early = [g for g in guards if g.ready_ts is not None and g.stop_ts is None]
    if stopped_early and sacct is not None and all(c.coarse_state != "RUNNING" for c in sacct.components):
        g = stopped_early[0]
        return make(
            Cause("guard_unreachable", "guard unreachable", "no guard_stop event"), "guard", host=g.host
        )
    if not children and logs_fallback:
        return logs_only_failure(run_dir)
    return None


def logs_only_failure(run_dir: Path) -> FirstFailure | None:
    """No guard events: the child log with a traceback that was modified first."""
    logs = run_dir / LOGS_DIR
    found = []
    for path in sorted(logs.glob("*/*.err")) if logs.is_dir() else []:
        try:
            scan = scan_log(path)
        except OSError:
            continue
        if scan.last_traceback is not None:
            found.append((path.stat().st_mtime, path, scan))
    if not found:
        return None
    found.sort(key=lambda x: x[0])
    ts, path, scan = found[0]
    lines = [scan.last_traceback.exception_line, *scan.last_traceback.lines]  # type: ignore[union-attr]
    cause = classify_text(lines) or exception_cause(lines) or Cause(UNKNOWN, "traceback", None)
    signature = traceback_signature(scan)
    same = [str(p.relative_to(logs)) for _, p, s in found[1:] if traceback_signature(s) == signature]
    name = CHILD_LOG_RE.match(path.name)
    return FirstFailure(
        cause=cause,
        source="logs",
        host=path.parent.name,
        role=name["role"] if name else None,
        index=int(name["index"]) if name else None,
        generation=int(name["gen"]) if name else None,
        ts=ts,
        exception=scan.last_traceback.exception_line,  # type: ignore[union-attr]
        traceback=scan.last_traceback.lines,  # type: ignore[union-attr]
        same_on=tuple(same),
        log_path=str(path),
        log_tail=tuple(read_last_lines(path, EVIDENCE_TAIL_LINES)),
    )
