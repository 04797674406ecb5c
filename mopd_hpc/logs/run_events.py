"""Read the guards' event logs (`run_dir/events/<host>.guard.jsonl`) into per-child and per-guard records.

Format: `mopd_hpc.runtime.guard.events`. Files are streamed line by line; a torn or foreign line is skipped.
A child's exit counts as *guard-initiated* when the guard sent its group a signal (`kill` event) before the
exit, or the exit came after the guard was itself signalled (`guard_signal`: Slurm's SIGTERM/USR2 at
preemption, time limit or scancel): such exits are teardown, never the first failure.
"""

from __future__ import annotations

import json
import os
import signal as signal_mod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mopd_hpc.records.run_dir import EVENTS_DIR, EVENTS_SUFFIX

#: A child ended by the same signal up to this many seconds *before* its guard logged Slurm's signal is
#: teardown too: Slurm signals every process of the step at once, so the child's exit may be logged first.
#: A child ended by another signal just before (SIGKILL by the OOM killer or a user, then the batch shell's
#: `scancel --signal=TERM` reaching the guard) is the failure that caused the stop, not teardown.
TEARDOWN_SLACK_S = 2.0
TEARDOWN_SIGNALS = frozenset({"SIGTERM", "SIGUSR2", "SIGINT", "SIGKILL"})


@dataclass(frozen=True, slots=True)
class ChildRun:
    """One generation of (role, index) on `host`, as the guard saw it.

    Attributes:
        spawn_ts, exit_ts: Unix seconds; `exit_ts` is None while running (or when the guard died first).
        exit_code: the exit status, or None (killed by a signal, or not exited).
        signal: the signal name that ended it ("SIGKILL"), or None.
        guard_kill_ts: when the guard first signalled its group (None if never).
        teardown: the exit was guard-initiated (see the module docstring).
        stdout, stderr: the log paths the guard recorded (may be absolute paths of another machine).
        job_id: the job id of the guard that ran it (its `guard_start`), None when unknown.
        guard_done_ts: when its guard logged `plan_done` or `guard_stop` (the guard was done with it).
    """

    host: str
    role: str
    index: int
    generation: int
    pid: int | None
    spawn_ts: float | None
    exit_ts: float | None
    exit_code: int | None
    signal: str | None
    guard_kill_ts: float | None
    teardown: bool
    stdout: str | None
    stderr: str | None
    job_id: str | None = None
    guard_done_ts: float | None = None

    @property
    def failed(self) -> bool:
        """Ended badly: a non-zero exit code or a signal."""
        return (self.exit_code not in (None, 0)) or self.signal is not None

    @property
    def signum(self) -> int | None:
        try:
            return int(signal_mod.Signals[self.signal]) if self.signal else None
        except KeyError:
            return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "role": self.role,
            "index": self.index,
            "generation": self.generation,
            "pid": self.pid,
            "spawn_ts": self.spawn_ts,
            "exit_ts": self.exit_ts,
            "exit_code": self.exit_code,
            "signal": self.signal,
            "teardown": self.teardown,
            "stderr": self.stderr,
            "job_id": self.job_id,
        }


@dataclass(frozen=True, slots=True)
class GuardRun:
    """One guard process (one node of one job incarnation): start/ready/stop times and the signals it got.

    `plan_done_ts` is its `plan_done` event (it stopped watching its children); `last_ts` its last event.
    `exit_ts` / `exit_code` / `exit_signal`: its keeper's `guard_exit` event (the guard process ended; exit
    code, or the signal's name), None without one.
    """

    host: str
    job_id: str | None
    start_ts: float | None
    ready_ts: float | None
    stop_ts: float | None
    signals: tuple[tuple[float, str], ...]
    plan_done_ts: float | None = None
    last_ts: float | None = None
    exit_ts: float | None = None
    exit_code: int | None = None
    exit_signal: str | None = None

    @property
    def ended(self) -> bool:
        """The guard process is known to be gone: it logged `guard_stop`, or its keeper its exit."""
        return self.stop_ts is not None or self.exit_ts is not None

    @property
    def died(self) -> bool:
        """It ended without stopping: killed by a signal, or exited without `guard_stop` (a crash)."""
        return self.exit_ts is not None and (self.exit_signal is not None or self.stop_ts is None)

    @property
    def first_signal_ts(self) -> float | None:
        return self.signals[0][0] if self.signals else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "job_id": self.job_id,
            "start_ts": self.start_ts,
            "ready_ts": self.ready_ts,
            "stop_ts": self.stop_ts,
            "plan_done_ts": self.plan_done_ts,
            "signals": [{"ts": ts, "signal": name} for ts, name in self.signals],
            "exit": None
            if self.exit_ts is None
            else {"ts": self.exit_ts, "exit_code": self.exit_code, "signal": self.exit_signal},
        }


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _segment_runs(host: str, seg: dict[str, Any]) -> tuple[GuardRun, list[ChildRun]]:
    guard, signals, children = seg["guard"], seg["signals"], seg["children"]
    first_signal = signals[0] if signals else None
    done = [ts for ts in (guard["plan_done_ts"], guard["stop_ts"], guard["exit_ts"]) if ts is not None]
    runs = []
    for (role, index, gen), rec in children.items():
        exit_ts, kill_ts = rec.get("exit_ts"), rec.get("kill_ts")
        same_signal = first_signal is not None and rec.get("signal") == first_signal[1]
        slack = TEARDOWN_SLACK_S if same_signal and rec.get("signal") in TEARDOWN_SIGNALS else 0.0
        teardown = exit_ts is not None and (
            (kill_ts is not None and kill_ts <= exit_ts)
            or (first_signal is not None and first_signal[0] <= exit_ts + slack)
        )
        runs.append(
            ChildRun(
                host=host,
                role=role,
                index=index,
                generation=gen,
                pid=rec.get("pid"),
                spawn_ts=rec.get("spawn_ts"),
                exit_ts=exit_ts,
                exit_code=rec.get("exit_code"),
                signal=rec.get("signal") if isinstance(rec.get("signal"), str) else None,
                guard_kill_ts=kill_ts,
                teardown=teardown,
                stdout=rec.get("stdout") if isinstance(rec.get("stdout"), str) else None,
                stderr=rec.get("stderr") if isinstance(rec.get("stderr"), str) else None,
                job_id=guard["job_id"],
                guard_done_ts=min(done) if done else None,
            )
        )
    runs.sort(key=lambda c: (c.spawn_ts or 0.0, c.role, c.index, c.generation))
    return GuardRun(host=host, signals=tuple(signals), **guard), runs


def read_guard_segments(path: str | os.PathLike[str]) -> list[tuple[GuardRun, list[ChildRun]]]:
    """Stream one guard event log into one (GuardRun, ChildRuns) per guard process, oldest first.

    A run directory is reused on resume, resubmission and requeue, and every guard appends to the same
    `<host>.guard.jsonl`: each `guard_start` opens a new segment (lines before the first one form a segment
    without a job id). Teardown is decided within a segment only (a later job's signal never makes an
    earlier job's exit teardown, nor the other way round).

    Raises:
        OSError: the file cannot be read.
    """
    path = Path(path)
    host = path.name.removesuffix(EVENTS_SUFFIX)
    segments: list[dict[str, Any]] = []

    def new_segment() -> dict[str, Any]:
        guard = {"job_id": None, "start_ts": None, "ready_ts": None, "stop_ts": None}
        ends = {
            "plan_done_ts": None,
            "last_ts": None,
            "exit_ts": None,
            "exit_code": None,
            "exit_signal": None,
        }
        seg = {"guard": {**guard, **ends}, "signals": [], "children": {}}
        segments.append(seg)
        return seg

    seg: dict[str, Any] | None = None
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if not isinstance(ev, dict):
                continue
            kind, ts = ev.get("event"), _float(ev.get("ts"))
            host = str(ev.get("host") or host)
            if seg is None or kind == "guard_start":
                seg = new_segment()
            guard, children = seg["guard"], seg["children"]
            if ts is not None:
                guard["last_ts"] = ts if guard["last_ts"] is None else max(guard["last_ts"], ts)
            if kind == "guard_start":
                guard["start_ts"] = ts
                guard["job_id"] = None if ev.get("job_id") is None else str(ev["job_id"])
            elif kind == "guard_ready":
                guard["ready_ts"] = ts
            elif kind == "guard_stop":
                guard["stop_ts"] = ts
            elif kind == "guard_exit":
                sig = ev.get("signal")
                guard.update(exit_ts=ts, exit_code=_int(ev.get("exit_code")))
                guard["exit_signal"] = sig if isinstance(sig, str) else None
            elif kind == "plan_done" and guard["plan_done_ts"] is None:
                guard["plan_done_ts"] = ts
            elif kind == "guard_signal":
                seg["signals"].append((ts or 0.0, str(ev.get("signal"))))
            elif kind in ("spawn", "exit", "kill"):
                role, index, gen = ev.get("role"), _int(ev.get("index")), _int(ev.get("generation"))
                if not isinstance(role, str) or index is None or gen is None:
                    continue
                rec = children.setdefault((role, index, gen), {"pid": _int(ev.get("pid"))})
                if kind == "spawn":
                    rec.update(spawn_ts=ts, stdout=ev.get("stdout"), stderr=ev.get("stderr"))
                elif kind == "exit":
                    rec.update(exit_ts=ts, exit_code=_int(ev.get("exit_code")), signal=ev.get("signal"))
                elif rec.get("kill_ts") is None:
                    rec["kill_ts"] = ts
    return [_segment_runs(host, s) for s in segments]


def read_guard_events(path: str | os.PathLike[str]) -> tuple[GuardRun, list[ChildRun]]:
    """The latest guard process of one event log (`read_guard_segments`' last segment).

    Raises:
        OSError: the file cannot be read.
    """
    segments = read_guard_segments(path)
    if not segments:
        return GuardRun(Path(path).name.removesuffix(EVENTS_SUFFIX), None, None, None, None, ()), []
    return segments[-1]


def read_run_segments(run_dir: str | os.PathLike[str]) -> list[tuple[GuardRun, list[ChildRun]]]:
    """Every guard process of the run directory (hosts in name order, each host's oldest first)."""
    out: list[tuple[GuardRun, list[ChildRun]]] = []
    events_dir = Path(run_dir) / EVENTS_DIR
    if events_dir.is_dir():
        for path in sorted(events_dir.glob(f"*{EVENTS_SUFFIX}")):
            out += read_guard_segments(path)
    return out


def read_run_events(run_dir: str | os.PathLike[str]) -> tuple[list[GuardRun], list[ChildRun]]:
    """Every guard process and child of the run directory, of every job that used it (see `mopd_hpc.logs.jobs`
    to keep one job's)."""
    guards, children = [], []
    for guard, runs in read_run_segments(run_dir):
        guards.append(guard)
        children += runs
    return guards, children
