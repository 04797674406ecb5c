"""`mopd-logs summarize` after each fault of the hardening trial (issue 23), on the local backend: real
`mopd-submit --local --probe` runs of configs/local_cpu.yaml (one guard, its keeper, four probe children),
the fault applied from outside, then the summary of the run dir asserted — state, cause key and title, the
children's states, the CLI's exit code and screen.

- the guard SIGKILLed mid-run (no `guard_stop`; its children die with it): FAILED, "guard died: killed by
  signal 9 (SIGKILL)" from the keeper's `guard_exit` event; the guard and its keeper SIGKILLed together (no
  event at all): FAILED from the run-dir lock the job no longer holds — never RUNNING;
- SIGTERM to the `mopd-submit --local` process: CANCELLED, "terminated by SIGTERM";
- a second job on the same run dir: refused by the run-dir lock before anything starts; the first then
  fails (a child SIGKILLed): the summary is the first job's (FAILED, its child's signal), never the refused
  job's, and lists the refusal (job id, host, pid).
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import time
from pathlib import Path

from helpers_wait import until
from rich.console import Console
from test_local_backend import processes_of, reports, start
from test_logs_summary import RunBuilder

from mopd_hpc.cli import logs_summarize
from mopd_hpc.logs.render import render_summary
from mopd_hpc.logs.summary import RunSummary, no_sacct, summarize_run
from mopd_hpc.records.run_dir import guard_record_file
from mopd_hpc.runtime.guard.events import events_path, read_events
from mopd_hpc.runtime.run_lock import LOCK_FILE_NAME, acquire, holder_of

HOST = socket.gethostname()
HOLD = {"MOPD_PROBE_HOLD_S": "60"}  # the probes stay up until the fault ends them


def _started(run_dir: Path) -> bool:
    return len(reports(run_dir)) == 4 and guard_record_file(run_dir, HOST).is_file()


def _screen(summary: RunSummary) -> str:
    buf = io.StringIO()
    render_summary(summary, Console(file=buf, width=200, color_system=None))
    return buf.getvalue()


def _cli(run_dir: Path) -> tuple[int, dict]:
    out = io.StringIO()
    args = logs_summarize_args(str(run_dir), json_out=True)
    rc = logs_summarize.run(args, out=out, err=io.StringIO(), env={})
    return rc, json.loads(out.getvalue())


def logs_summarize_args(target: str, json_out: bool = False):
    import argparse

    return argparse.Namespace(target=target, json=json_out, plot=None, no_sacct=True)


def _child_states(summary: RunSummary) -> list[str]:
    return [slot.state for slot in summary.children]


def test_guard_sigkill_mid_run_is_a_failed_job_naming_the_guards_death(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start("local_cpu.yaml", run_dir, **HOLD)
    try:
        assert until(lambda: _started(run_dir), 120), proc.stderr
        guard_pid = json.loads(guard_record_file(run_dir, HOST).read_text())["pid"]
        assert (
            guard_pid != proc.pid
            and str(guard_pid) in (run_dir / "events").joinpath(f"{HOST}.guard.jsonl").read_text()
        )
        os.kill(guard_pid, signal.SIGKILL)  # the fault: the guard process only (its keeper lives on)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGKILL, err + out  # the keeper ended as the guard did
    assert "the guard was killed by SIGKILL" in out
    assert until(lambda: processes_of(run_dir) == [], 10), processes_of(run_dir)  # children died with it
    events = read_events(events_path(run_dir, HOST))
    assert not [e for e in events if e["event"] == "guard_stop"]  # the guard wrote no end of its own
    (exit_event,) = [e for e in events if e["event"] == "guard_exit"]  # its keeper did
    assert (exit_event["pid"], exit_event["signal"], exit_event["exit_code"]) == (guard_pid, "SIGKILL", None)

    s = summarize_run(run_dir, sacct_runner=no_sacct)
    assert (s.job.job_id, s.job.state, s.job.state_source) == (f"local-{proc.pid}", "FAILED", "run_dir")
    f = s.first_failure
    assert f is not None and (f.cause.key, f.cause.title, f.source, f.host) == (
        "guard_died", "guard died: killed by signal 9 (SIGKILL)", "guard", HOST)  # fmt: skip
    assert f.cause.evidence == "guard_exit signal=SIGKILL" and f.ts == exit_event["ts"]
    assert _child_states(s) == ["stopped"] * 4  # no exit event (their guard was dead), not "running"
    assert s.next_steps == (f"mopd-submit {run_dir}/config.yaml --resume {run_dir}",)
    screen = _screen(s)
    assert "state FAILED" in screen and "guard died: killed by signal 9 (SIGKILL)" in screen
    assert "RUNNING" not in screen and "SUCCEEDED" not in screen
    rc, doc = _cli(run_dir)
    assert rc == logs_summarize.EXIT_FAILED_RUN and doc["job"]["state"] == "FAILED"
    assert doc["nodes"][0]["guard"]["exit"]["signal"] == "SIGKILL"

    again = start("local_cpu.yaml", run_dir)  # the next job on the run dir: the dead one stays FAILED
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err + out
    s2 = summarize_run(run_dir, sacct_runner=no_sacct)
    assert (s2.job.job_id, s2.job.state) == (f"local-{again.pid}", "SUCCEEDED")
    assert s2.job.earlier_jobs == ((f"local-{proc.pid}", "FAILED"),)


def test_guard_and_keeper_sigkilled_together_is_failed_not_running(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start("local_cpu.yaml", run_dir, **HOLD)
    try:
        assert until(lambda: _started(run_dir), 120), proc.stderr
        guard_pid = json.loads(guard_record_file(run_dir, HOST).read_text())["pid"]
        os.killpg(os.getpgid(guard_pid), signal.SIGKILL)  # the fault: guard and keeper at once, no event
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGKILL, err + out
    assert until(lambda: processes_of(run_dir) == [], 10), processes_of(run_dir)
    kinds = {e["event"] for e in read_events(events_path(run_dir, HOST))}
    assert not kinds & {"guard_stop", "guard_exit"}
    assert holder_of(run_dir) is None  # mopd-submit released the lock when the guard was gone
    s = summarize_run(run_dir, sacct_runner=no_sacct)
    assert (s.job.state, s.first_failure.cause.key, s.first_failure.source) == (
        "FAILED",
        "guard_died",
        "guard",
    )
    assert "the job no longer holds its run-dir lock" in s.first_failure.cause.title
    assert _child_states(s) == ["stopped"] * 4


def test_sigterm_of_a_local_run_is_cancelled_naming_the_signal(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start("local_cpu.yaml", run_dir, **HOLD)
    try:
        assert until(lambda: _started(run_dir), 120), proc.stderr
        proc.send_signal(signal.SIGTERM)  # the fault: `kill <pid of mopd-submit --local>`
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err + out
    assert "Traceback" not in err + out
    assert until(lambda: processes_of(run_dir) == [], 10), processes_of(run_dir)
    s = summarize_run(run_dir, sacct_runner=no_sacct)
    assert (s.job.job_id, s.job.state, s.job.state_source) == (f"local-{proc.pid}", "CANCELLED", "run_dir")
    f = s.first_failure
    assert f is not None and (f.cause.key, f.cause.evidence, f.source) == (
        "terminated", "guard got SIGTERM", "slurm_signal")  # fmt: skip
    assert f.cause.title == "terminated by SIGTERM (sent to mopd-submit --local or its guard)"
    assert _child_states(s) == ["killed"] * 4  # torn down by the guard, not failures
    assert s.next_steps == (f"mopd-submit {run_dir}/config.yaml --resume {run_dir}",)
    screen = _screen(s)
    assert "state CANCELLED" in screen and "terminated by SIGTERM" in screen and "scancel" not in screen
    rc, doc = _cli(run_dir)
    assert rc == logs_summarize.EXIT_FAILED_RUN and doc["job"]["state"] == "CANCELLED"


def test_a_second_job_is_refused_and_the_summary_is_the_first_jobs_true_outcome(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = start("local_cpu.yaml", run_dir, **HOLD)
    try:
        assert until(lambda: _started(run_dir), 120), first.stderr
        second = start("local_cpu.yaml", run_dir)  # the fault: a second job on the same run dir
        out2, err2 = second.communicate(timeout=120)
        assert second.returncode == 2 and out2 == "", err2
        assert f"is in use by job local-{first.pid} (host {HOST}, pid {first.pid}" in err2
        assert f"local-{second.pid}" not in (run_dir / "events" / f"{HOST}.guard.jsonl").read_text()
        actor = next(r for r in reports(run_dir) if r["plan_role"] == "actor")
        t_kill = time.time()
        os.kill(actor["pid"], signal.SIGKILL)  # then the first job fails: its actor is SIGKILLed
        out, err = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode != 0, err + out
    assert until(lambda: processes_of(run_dir) == [], 10), processes_of(run_dir)
    s = summarize_run(run_dir, sacct_runner=no_sacct)
    assert (s.job.job_id, s.job.state) == (f"local-{first.pid}", "FAILED")  # the first job, not the refused
    f = s.first_failure
    assert f is not None and (f.cause.key, f.cause.title, f.source) == (
        "killed_by_signal", "killed by signal 9 (SIGKILL)", "events")  # fmt: skip
    assert (f.role, f.index, f.signal) == ("probe", 0, "SIGKILL") and f.ts >= t_kill
    assert s.job.earlier_jobs == () and s.job.later_jobs == ()  # the refused job left no events
    ((refused, host, pid, ts),) = s.job.refused
    assert (refused, host, pid) == (f"local-{second.pid}", HOST, second.pid) and ts < t_kill
    screen = _screen(s)
    assert "state FAILED" in screen and "SUCCEEDED" not in screen
    assert (
        f"refused while this job held the run dir: job local-{second.pid} (host {HOST}, pid {second.pid})"
        in screen
    )
    rc, doc = _cli(run_dir)
    assert rc == logs_summarize.EXIT_FAILED_RUN
    assert doc["job"]["refused"] == [
        {"job_id": f"local-{second.pid}", "host": HOST, "pid": second.pid, "ts": ts}
    ]


def test_a_local_guard_without_an_end_is_running_only_while_its_job_holds_the_lock(tmp_path: Path) -> None:
    """The lock inference alone (events written here, the lock taken in this process): a guard with neither
    `guard_stop` nor `guard_exit` is RUNNING while its job holds run.lock, and FAILED (guard_died) once the
    lock is free or another job holds it; without a lock record (an older run dir, a file system without
    flock) nothing is inferred: RUNNING, as before."""
    b = RunBuilder(tmp_path / "run", job_id="local-7")
    (b.root / "state" / "job.json").unlink()  # the local backend writes no job.json
    b.guard("n1")
    b.child("n1", "actor", 0, 1.0)
    root = b.write()

    def verdict() -> tuple[str, str | None]:
        s = summarize_run(root, sacct_runner=no_sacct)
        return s.job.state, s.first_failure.cause.key if s.first_failure else None

    assert verdict() == ("RUNNING", None)  # no run.lock at all
    lock = acquire(root, "local-7", "n1")
    assert verdict() == ("RUNNING", None)  # held by its job
    lock.release()
    assert verdict() == ("FAILED", "guard_died")  # its record, nobody holds it
    other = acquire(root, "local-8", "n1")
    try:
        assert verdict() == ("FAILED", "guard_died")  # another job holds it: local-7 is gone
    finally:
        other.release()
    (root / LOCK_FILE_NAME).write_text("")  # a lock file without a record: no inference
    assert verdict() == ("RUNNING", None)
