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
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mopd_hpc.logs.causes import (
    CONSEQUENCE_KEYS,
    STEP_FAILED,
    UNKNOWN,
    Cause,
    cancelled_cause,
    classify_text,
    exception_cause,
    exit_cause,
    guard_death_cause,
    guard_gone_cause,
    guard_signal_cause,
    signal_cause,
)
from mopd_hpc.logs.index import LOCAL_JOB_ID
from mopd_hpc.logs.jobs import job_log_paths, leader_of, record_belongs
from mopd_hpc.logs.run_events import ChildRun, GuardRun
from mopd_hpc.logs.sacct import SacctJob
from mopd_hpc.logs.scan import ScanResult, scan_log
from mopd_hpc.logs.tailing import CHILD_LOG_RE, read_last_lines
from mopd_hpc.records.run_dir import LOGS_DIR, STATE_DIR, child_log_paths

#: Lines of the failing log shown as evidence (STYLE.md rule 9).
EVIDENCE_TAIL_LINES = 40
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
_NORMALIZERS = (
    (re.compile(r"0x[0-9a-fA-F]+"), "0xADDR"),
    (re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?Z?"), "TIME"),
    (re.compile(r"\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?"), "ADDR"),
    (re.compile(r"\d+"), "N"),
)


def normalize_line(line: str) -> str:
    """`line` with addresses, times, IPs and every number replaced, to compare tracebacks across ranks."""
    for pattern, repl in _NORMALIZERS:
        line = pattern.sub(repl, line)
    return line.strip()


def traceback_signature(scan: ScanResult | None) -> tuple[str, ...] | None:
    """The normalized fatal (last) traceback of a scanned log, or None without one."""
    if scan is None or scan.last_traceback is None:
        return None
    return tuple(normalize_line(x) for x in scan.last_traceback.lines)


def child_label(child: ChildRun) -> str:
    """`n2 actor-1` (`n2 actor-1.g2` for a restarted generation)."""
    gen = f".g{child.generation}" if child.generation > 1 else ""
    return f"{child.host} {child.role}-{child.index}{gen}"


@dataclass(frozen=True, slots=True)
class FirstFailure:
    """The earliest failure. Child fields are None when the failure is not a child's (time limit, guard).

    Attributes:
        source: what decided: "events", "slurm_signal", "guard", "batch_state", "sacct" or "logs".
        traceback: the fatal traceback, bounded (scan.TB_HEAD_LINES + TB_TAIL_LINES lines).
        same_on: labels of the other children whose fatal traceback is the same after normalization.
        cascade: (label, cause key) of the later failing children, in time order.
        log_path / log_tail: the log that shows it and its last EVIDENCE_TAIL_LINES lines.
    """

    cause: Cause
    source: str
    host: str | None = None
    role: str | None = None
    index: int | None = None
    generation: int | None = None
    ts: float | None = None
    exit_code: int | None = None
    signal: str | None = None
    exception: str | None = None
    traceback: tuple[str, ...] = ()
    same_on: tuple[str, ...] = ()
    cascade: tuple[tuple[str, str], ...] = ()
    log_path: str | None = None
    log_tail: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "cause": self.cause.to_dict(),
            "source": self.source,
            "host": self.host,
            "role": self.role,
            "index": self.index,
            "generation": self.generation,
            "ts": self.ts,
            "exit_code": self.exit_code,
            "signal": self.signal,
            "exception": self.exception,
            "traceback": list(self.traceback),
            "same_on": list(self.same_on),
            "same_on_count": len(self.same_on),
            "cascade": [{"child": label, "cause": key} for label, key in self.cascade],
            "log_path": self.log_path,
            "log_tail": list(self.log_tail),
        }


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
    return _job_level_failure(run_dir, guards, children, sacct, job_id, restart, logs_fallback, lock_released)


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


def _job_level_failure(
    run_dir: Path,
    guards: Sequence[GuardRun],
    children: Sequence[ChildRun],
    sacct: SacctJob | None,
    job_id: str | None = None,
    restart: int | None = None,
    logs_fallback: bool = True,
    lock_released: bool = False,
) -> FirstFailure | None:
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
        return _logs_only_failure(run_dir)
    return None


def _logs_only_failure(run_dir: Path) -> FirstFailure | None:
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
