"""The first failure of a run: which child failed first in time, why, and on how many ranks the same happened.

Failures cascade (one rank's CUDA OOM becomes every other rank's NCCL timeout), so the earliest failing exit
wins, unless its cause is a consequence (`causes.CONSEQUENCE_KEYS`: a rank whose gloo peer closed its
connection, or whose collective timed out, after another rank died): then the earliest failing exit whose
cause is not one wins (the guards of two nodes stamp exits with two clocks, and a rank can notice its peer's
death before the peer's guard reports it), and the consequences are its cascade. A failing exit is a non-zero exit code or a signal that the guard did not cause: exits after the guard's
own `kill` or after Slurm signalled the guard are teardown (`run_events`). Order of evidence:

1. guard events: the earliest failing child exit; its stderr (and stdout) are scanned for the fatal traceback
   and classified (`causes`); a signal without a traceback is "killed by signal N";
2. without a failing child: Slurm's signal to the guards (time limit, preemption, requeue: sacct state,
   `state/requeue.json`, slurmstepd lines; on a local run a stop signal sent to `mopd-submit --local`), a
   guard that died (its keeper's `guard_exit` without `guard_stop`: SIGKILL, crash; on a local run also a
   guard with neither whose job no longer holds the run-dir lock), a guard that never became ready or never
   stopped (guard unreachable), the batch shell's `state/first_failure.json`, a failed sacct component;
3. without guard events: child logs with a traceback, oldest modification first.

Only one job's evidence counts (a run dir is reused on resume, resubmission and requeue): the caller passes
that job's guards and children (`jobs.select_job`), and `state/*.json`, `batch.<id>.log` and step logs
(`<component>.r<restart>.t<task>.log`) written by another job id or an earlier incarnation are left out.

Tracebacks are compared across ranks after `normalize_line` (numbers, addresses, times): "same on N other ranks".

Modules: this one decides step 1 (a child's failing exit) and hands the rest to `job_failure` (steps 2, 3);
the record is `failure_record.FirstFailure`, the traceback comparison `signature`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from mopd_hpc.logs.causes import (
    CONSEQUENCE_KEYS,
    Cause,
    classify_text,
    exception_cause,
    exit_cause,
    signal_cause,
)
from mopd_hpc.logs.failure_record import EVIDENCE_TAIL_LINES, FirstFailure
from mopd_hpc.logs.job_failure import job_level_failure
from mopd_hpc.logs.run_events import ChildRun, GuardRun
from mopd_hpc.logs.sacct import SacctJob
from mopd_hpc.logs.scan import ScanResult, scan_log
from mopd_hpc.logs.signature import child_label, normalize_line, traceback_signature
from mopd_hpc.logs.tailing import read_last_lines
from mopd_hpc.records.run_dir import child_log_paths

__all__ = [
    "EVIDENCE_TAIL_LINES",
    "FirstFailure",
    "child_label",
    "child_log",
    "classify_child",
    "find_first_failure",
    "normalize_line",
    "traceback_signature",
]


def child_log(run_dir: Path, child: ChildRun, stream: str) -> Path | None:
    """The child's log in *this* copy of the run dir (`logs/<host>/<role>-<index>.g<gen>.<stream>`), else
    the path the guard recorded; None when neither exists."""
    local = child_log_paths(run_dir, child.host, child.role, child.index, child.generation)[stream == "err"]
    if local.is_file():
        return local
    recorded = child.stderr if stream == "err" else child.stdout
    if recorded and Path(recorded).is_file():
        return Path(recorded)
    return None


def classify_child(child: ChildRun, scans: list[ScanResult]) -> Cause:
    """The cause of one child's failing exit, from its scanned logs and how it ended."""
    tb_lines: list[str] = []
    hit_lines: list[str] = []
    for scan in scans:
        if scan.last_traceback is not None:
            tb_lines += [scan.last_traceback.exception_line, *scan.last_traceback.lines]
        hit_lines += [line for _, line in (*scan.last_hits, *scan.first_hits)]
    cause = classify_text(tb_lines)
    if cause is None and child.signal is None:
        cause = classify_text(hit_lines)
    if cause is None and child.signal is not None:
        cause = classify_text(hit_lines) if child.signal == "SIGKILL" else None
        if cause is not None and cause.key != "host_oom":
            cause = None
        cause = cause or signal_cause(child.signal, child.signum)
    if cause is None:
        cause = exception_cause(tb_lines) or exit_cause(
            child.exit_code if child.exit_code is not None else -1
        )
    return cause


def find_first_failure(
    run_dir: Path,
    guards: Sequence[GuardRun],
    children: Sequence[ChildRun],
    sacct: SacctJob | None,
    scans: Mapping[str, ScanResult],
    job_id: str | None = None,
    restart: int | None = None,
    logs_fallback: bool = True,
    lock_released: bool = False,
) -> FirstFailure | None:
    """Decide the first failure (module docstring); `scans` maps a log path to its scan (missing → scanned).

    `guards`/`children` are one job's (`jobs.select_job`); `job_id` (leader) and `restart` (its incarnation,
    SLURM_RESTART_COUNT) keep out the state files and job logs another job or an earlier incarnation wrote;
    None does not filter. `logs_fallback=False` skips step 3 (the child logs are another job's).
    `lock_released`: the job is a local one that no longer holds its run-dir lock (every process of it is
    gone), so a guard of it that logged no end died.
    """
    scan_cache = dict(scans)

    def scans_of(child: ChildRun, with_stdout: bool) -> tuple[list[ScanResult], Path | None]:
        out, first_path = [], None
        for stream in ("err", "out") if with_stdout else ("err",):
            path = child_log(run_dir, child, stream)
            if path is None:
                continue
            key = str(path)
            if key not in scan_cache:
                try:
                    scan_cache[key] = scan_log(path)
                except OSError:
                    continue
            out.append(scan_cache[key])
            first_path = first_path or path
        return out, first_path

    failing = sorted(
        (c for c in children if c.failed and c.exit_ts is not None and not c.teardown),
        key=lambda c: (c.exit_ts, c.host, c.role, c.index),
    )
    if failing:
        causes = {id(c): classify_child(c, scans_of(c, with_stdout=True)[0]) for c in failing}
        primary = [c for c in failing if causes[id(c)].key not in CONSEQUENCE_KEYS]
        first = primary[0] if primary else failing[0]
        failing = [first, *(c for c in failing if c is not first)]
        first_scans, path = scans_of(first, with_stdout=True)
        cause = causes[id(first)]
        err_scan = first_scans[0] if first_scans else None
        signature = traceback_signature(err_scan)
        same_on = []
        if signature is not None:
            for other in children:
                if other is first:
                    continue
                other_scans, _ = scans_of(other, with_stdout=False)
                if other_scans and traceback_signature(other_scans[0]) == signature:
                    same_on.append(child_label(other))
        cascade = [(child_label(other), causes[id(other)].key) for other in failing[1:]]
        tb = err_scan.last_traceback if err_scan is not None else None
        return FirstFailure(
            cause=cause,
            source="events",
            host=first.host,
            role=first.role,
            index=first.index,
            generation=first.generation,
            ts=first.exit_ts,
            exit_code=first.exit_code,
            signal=first.signal,
            exception=tb.exception_line if tb else None,
            traceback=tb.lines if tb else (),
            same_on=tuple(same_on),
            cascade=tuple(cascade),
            log_path=str(path) if path else None,
            log_tail=tuple(read_last_lines(path, EVIDENCE_TAIL_LINES)) if path else (),
        )
    return job_level_failure(run_dir, guards, children, sacct, job_id, restart, logs_fallback, lock_released)
