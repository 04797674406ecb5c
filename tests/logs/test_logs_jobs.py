"""`mopd-logs summarize` on a run dir reused by several jobs: a scancel'ed job then a resubmission that finished,
a Ctrl-C'ed local run then a successful one, a job requeued mid-run that resumed and finished, and a cancelled
job whose guards stopped without child exit events. The run dirs are written the way the guards (appending to
`events/<host>.guard.jsonl`) and the batch shell (`state/*.json`, `logs/batch.<id>.log`) write them; sacct
answers are recorded text per job id. Asserts the job shown, its state, the exit code, the first failure (or
none), the children's states and the other jobs listed."""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from pathlib import Path

from test_logs_summary import T0, RunBuilder, _render, logs_cli_args

from mopd_hpc.cli import logs_summarize
from mopd_hpc.logs.index import append_job_index
from mopd_hpc.logs.jobs import incarnations_of, record_belongs, select_job
from mopd_hpc.logs.run_events import read_run_segments
from mopd_hpc.logs.sacct import SACCT_FIELDS
from mopd_hpc.logs.summary import no_sacct, summarize_run

HOSTS = ("n1", "n2")


def sacct_row(job_id: str, state: str, exit_code: str = "0:0") -> str:
    row = {"JobID": job_id, "JobName": "mopd", "State": state, "ExitCode": exit_code, "NNodes": "2"}
    return "|".join(row.get(f, "") for f in SACCT_FIELDS)


def sacct_runner(jobs: dict[str, Sequence[str]]):
    """A runner answering `--jobs=ID` with the rows of `jobs[ID]` (one per incarnation, oldest first)."""
    calls: list[str] = []

    def run(argv: Sequence[str]) -> str:
        job = next(a.removeprefix("--jobs=") for a in argv if a.startswith("--jobs="))
        calls.append(job)
        return "\n".join(["|".join(SACCT_FIELDS), *jobs.get(job, ())]) + "\n"

    run.calls = calls  # type: ignore[attr-defined]
    return run


def write_job_json(root: Path, job_id: str, restart: int) -> None:
    record = {"job_id": job_id, "restart_count": restart, "shape": "colocated", "components": ["main"]}
    (root / "state" / "job.json").write_text(json.dumps(record))


def job_run(b: RunBuilder, job_id: str, start: float, signal: str | None = None, ok: bool = True) -> None:
    """One job incarnation on HOSTS: an actor and a rollout per host; `signal` to the guards at start+50
    tears the children down; else they exit 0 (ok) at start+90."""
    b.job_id = job_id
    for host in HOSTS:
        b.guard(host, start=start)
        for role in ("actor", "rollout"):
            if signal is not None:
                b.child(host, role, 0, start + 1, exit_at=start + 50.3, sig=signal, killed_at=start + 50.2)
            else:
                b.child(host, role, 0, start + 1, exit_at=start + 90, exit_code=0 if ok else 1)
        if signal is not None:
            b.guard_signal(host, start + 50, signal)
        b._emit(host, start + 95 if signal is None else start + 51, "plan_done", exit_code=0)
        b.guard_stop(host, start + 96 if signal is None else start + 52)


def cancelled_then_completed(root: Path) -> Path:
    b = RunBuilder(root, job_id="365")
    job_run(b, "365", 0.0, signal="SIGTERM")
    (root / "state" / "last_signal.json").write_text(
        json.dumps({"signal": "TERM", "job_id": "365", "restart_count": 0, "time_unix": int(T0 + 50)})
    )
    (root / "state" / "first_failure.json").write_text(
        json.dumps(
            {"component": "main", "het_group": 0, "exit_code": 143, "job_id": "365", "restart_count": 0}
        )
    )
    (root / "logs" / "batch.365.log").write_text(
        "slurmstepd: error: *** JOB 365 ON n1 CANCELLED AT 2026-11-29T21:20:58 ***\n"
    )
    # the step log is shared by every job's incarnation 0; a line naming another job is never this job's cause
    (root / "logs" / "main.r0.t0.log").write_text(
        "slurmstepd: error: *** STEP 999.0 ON n1 CANCELLED AT 2026-11-29T21:20:58 DUE TO TIME LIMIT ***\n"
    )
    job_run(b, "367", 1000.0)
    write_job_json(root, "367", 0)
    b.metrics(20)
    return b.write()


SACCT_365_367 = {
    "365": [sacct_row("365", "CANCELLED by 1000", "0:15")],
    "367": [sacct_row("367", "COMPLETED")],
}


def test_resubmission_after_scancel_is_its_own_job(tmp_path: Path) -> None:
    root = cancelled_then_completed(tmp_path / "run")
    runner = sacct_runner(SACCT_365_367)
    s = summarize_run(root, sacct_runner=runner)
    assert (s.job.job_id, s.job.state, s.job.state_source, s.first_failure) == (
        "367",
        "SUCCEEDED",
        "sacct",
        None,
    )
    assert [c.state for c in s.children] == ["exited"] * 4
    assert [g.signals for g in s.guards] == [(), ()] and [g.job_id for g in s.guards] == ["367", "367"]
    assert s.job.earlier_jobs == (("365", "CANCELLED"),) and s.job.later_jobs == ()
    assert s.job.restart_count == 0 and s.next_steps == ()
    assert runner.calls == ["367", "365"]
    screen = _render(s)
    assert "earlier jobs in this run dir: 365 CANCELLED" in screen
    assert "SIGTERM" not in screen and "no failure found" in screen and "killed" not in screen
    # without sacct: the run dir alone decides; the earlier job's verdict comes from its events
    s2 = summarize_run(root, sacct_runner=no_sacct)
    assert (s2.job.job_id, s2.job.state, s2.first_failure) == ("367", "SUCCEEDED", None)
    assert s2.job.earlier_jobs == (("365", "SIGNALLED"),)
    # the CLI by job id (through the index): exit 0
    state_home = tmp_path / "state"
    for job in ("365", "367"):
        append_job_index({"job_id": job, "run_dir": str(root), "submitted_at": T0}, state_home)
    env = {"XDG_STATE_HOME": str(state_home)}
    out = io.StringIO()
    rc = logs_summarize.run(logs_cli_args("367", json_out=True), out=out, env=env, sacct_runner=runner)
    doc = json.loads(out.getvalue())
    assert rc == 0 and doc["first_failure"] is None and doc["job"]["state"] == "SUCCEEDED"
    assert doc["job"]["earlier_jobs"] == [{"job_id": "365", "state": "SIGNALLED"}]  # --no-sacct in the args
    # asking for the cancelled job describes that job: its SIGTERM, its torn-down children
    out = io.StringIO()
    rc = logs_summarize.run(logs_cli_args("365", json_out=True), out=out, env=env)
    doc = json.loads(out.getvalue())
    assert rc == logs_summarize.EXIT_FAILED_RUN and doc["job"]["job_id"] == "365"
    # the slurmstepd line of job 365 names the reason (sacct is off: no uid)
    assert doc["first_failure"]["cause"] == {
        "key": "cancelled",
        "title": "cancelled (scancel)",
        "evidence": "slurmstepd: error: *** JOB 365 ON n1 CANCELLED AT 2026-11-29T21:20:58 ***",
    }
    assert doc["job"]["later_jobs"] == [{"job_id": "367", "state": "ENDED"}]
    assert {c["state"] for n in doc["nodes"] for c in n["children"]} == {"killed"}
    assert doc["job"]["shape"] is None  # state/job.json is job 367's record
    s3 = summarize_run(root, sacct_runner=runner, job_id="365")
    assert (s3.job.state, s3.job.later_jobs) == ("CANCELLED", (("367", "SUCCEEDED"),))
    # with sacct, "CANCELLED by 1000" names who cancelled it
    assert (s3.first_failure.cause.key, s3.first_failure.cause.title) == (
        "cancelled",
        "cancelled by uid 1000 (scancel)",
    )
    assert s3.first_failure.cause.evidence == (
        "slurmstepd: error: *** JOB 365 ON n1 CANCELLED AT 2026-11-29T21:20:58 ***; sacct 365 State=CANCELLED by 1000"
    )
    assert s3.first_failure.log_path.endswith("batch.365.log")
    # the same line naming job 365 is its cause
    (root / "logs" / "main.r0.t0.log").write_text(
        "slurmstepd: error: *** STEP 365.0 ON n1 CANCELLED AT 2026-11-29T21:20:58 DUE TO TIME LIMIT ***\n"
    )
    s4 = summarize_run(root, sacct_runner=no_sacct, job_id="365")
    assert s4.first_failure.cause.key == "time_limit" and s4.first_failure.log_path.endswith("main.r0.t0.log")
    assert summarize_run(root, sacct_runner=no_sacct).first_failure is None


def test_successful_run_after_ctrl_c_and_sigint_wording(tmp_path: Path) -> None:
    root = tmp_path / "run"
    b = RunBuilder(root, job_id="local-11")
    (root / "state" / "job.json").unlink()  # the local backend writes no job.json
    job_run(b, "local-11", 0.0, signal="SIGINT")
    job_run(b, "local-12", 500.0)
    b.write()
    s = summarize_run(root, sacct_runner=no_sacct)
    assert (s.job.job_id, s.job.state, s.first_failure) == ("local-12", "SUCCEEDED", None)
    assert s.job.earlier_jobs == (("local-11", "INTERRUPTED"),)
    assert [c.state for c in s.children] == ["exited"] * 4
    assert logs_summarize.run(logs_cli_args(str(root)), out=io.StringIO(), env={}) == 0
    s1 = summarize_run(root, sacct_runner=no_sacct, job_id="local-11")
    f = s1.first_failure
    assert (f.cause.key, f.cause.title, f.source) == ("interrupted", "interrupted (Ctrl-C)", "slurm_signal")
    assert s1.next_steps == (f"mopd-submit {root}/config.yaml --resume {root}",)
    screen = _render(s1)
    assert "interrupted (Ctrl-C)" in screen and "scancel" not in screen
    assert "later jobs in this run dir: local-12 ENDED" in screen


def requeued_then_finished(root: Path, with_job_json: bool = True) -> Path:
    b = RunBuilder(root, job_id="500")
    job_run(b, "500", 0.0, signal="SIGTERM")  # incarnation 0: scontrol requeue mid-run
    (root / "state" / "requeue.json").write_text(
        json.dumps({"job_id": "500", "restart_count": 0, "signal": "TERM", "time_unix": int(T0 + 55)})
    )
    (root / "logs" / "batch.500.log").write_text(
        "slurmstepd: error: *** JOB 500 ON n1 CANCELLED AT 2026-11-29T21:20:01 DUE TO JOB REQUEUE ***\n"
        "mopd[batch 2026-11-29T21:21:00Z] done: every step ended first with exit code 0\n"
    )
    job_run(b, "500", 300.0)  # incarnation 1 (SLURM_RESTART_COUNT=1): resumed, finished
    if with_job_json:
        write_job_json(root, "500", 1)
    else:
        (root / "state" / "job.json").unlink()
    b.metrics(30)
    return b.write()


def test_requeued_job_that_resumed_and_finished_is_not_a_failure(tmp_path: Path) -> None:
    root = requeued_then_finished(tmp_path / "run")
    runner = sacct_runner({"500": [sacct_row("500", "REQUEUED"), sacct_row("500", "COMPLETED")]})
    s = summarize_run(root, sacct_runner=runner)
    assert (s.job.state, s.job.restart_count, s.job.requeues, s.first_failure) == ("SUCCEEDED", 1, 1, None)
    assert s.next_steps == () and s.job.earlier_jobs == ()
    assert [(c.state, c.restarts) for c in s.children] == [("exited", 0)] * 4
    assert all(g.start_ts == T0 + 300 and g.signals == () for g in s.guards)
    screen = _render(s)
    assert "requeued once, resumed, finished" in screen and "preempted" not in screen
    assert "--resume" not in screen
    out = io.StringIO()
    assert logs_summarize.run(logs_cli_args(str(root)), out=out, env={}, sacct_runner=runner) == 0
    # without sacct and without job.json: the two incarnations are told apart by the events alone
    root2 = requeued_then_finished(tmp_path / "run2", with_job_json=False)
    s2 = summarize_run(root2, sacct_runner=no_sacct)
    assert (s2.job.job_id, s2.job.state, s2.job.restart_count, s2.first_failure) == (
        "500",
        "SUCCEEDED",
        1,
        None,
    )


def test_requeue_of_the_current_incarnation_is_still_reported(tmp_path: Path) -> None:
    """Incarnation 0 only, requeued (requeue.json of restart 0): the requeue is this incarnation's stop."""
    root = tmp_path / "run"
    b = RunBuilder(root, job_id="501")
    job_run(b, "501", 0.0, signal="SIGTERM")
    (root / "state" / "requeue.json").write_text(
        json.dumps({"job_id": "501", "restart_count": 0, "signal": "TERM"})
    )
    s = summarize_run(b.write(), sacct_runner=no_sacct)
    assert (s.first_failure.cause.key, s.first_failure.cause.title) == ("preempted", "preempted/requeued")


def test_cancelled_job_children_without_exit_events_are_stopped(tmp_path: Path) -> None:
    root = tmp_path / "run"
    b = RunBuilder(root, job_id="600")
    for host in HOSTS:
        b.guard(host)
        b.child(host, "actor", 0, 1)  # no exit event: the guard was killed before it logged one
        b.guard_signal(host, 40, "SIGTERM")
        b._emit(host, 40.2, "plan_done", exit_code=0)
    b.guard("n3")
    b.child("n3", "teacher", 0, 1)  # neither plan_done nor guard_stop: only the job's end proves it
    b.guard_signal("n3", 40, "SIGTERM")
    b.write()
    runner = sacct_runner({"600": [sacct_row("600", "CANCELLED by 1000", "0:15")]})
    s = summarize_run(root, sacct_runner=runner)
    assert s.job.state == "CANCELLED"
    assert {(c.host, c.role): c.state for c in s.children} == {
        ("n1", "actor"): "stopped",
        ("n2", "actor"): "stopped",
        ("n3", "teacher"): "stopped",
    }
    assert s.first_failure.cause.to_dict() == {  # sacct names who cancelled it
        "key": "cancelled",
        "title": "cancelled by uid 1000 (scancel)",
        "evidence": "sacct 600 State=CANCELLED by 1000",
    }
    assert "running" not in _render(s)
    assert {c["state"] for n in json.loads(s.to_json())["nodes"] for c in n["children"]} == {"stopped"}
    # without sacct: the run dir shows a signalled, stopped job (not RUNNING), so no child is running
    s2 = summarize_run(root, sacct_runner=no_sacct)
    assert (s2.job.state, s2.job.state_source) == ("FAILED", "run_dir")
    assert {c.state for c in s2.children} == {"stopped"}
    # a guard still live and unsignalled (job running): plan_done alone proves its children stopped
    b2 = RunBuilder(tmp_path / "run2", job_id="601")
    b2.guard("n1")
    b2.child("n1", "actor", 0, 1)
    b2._emit("n1", 30, "plan_done", exit_code=0)
    b2.guard("n2")
    b2.child("n2", "actor", 0, 1)
    s3 = summarize_run(b2.write(), sacct_runner=no_sacct)
    assert s3.job.state == "RUNNING"
    assert {(c.host, c.state) for c in s3.children} == {("n1", "stopped"), ("n2", "running")}


def test_segments_incarnations_and_state_records(tmp_path: Path) -> None:
    root = requeued_then_finished(tmp_path / "run")
    segments = read_run_segments(root)
    assert [(g.host, g.job_id, g.start_ts - T0) for g, _ in segments] == [
        ("n1", "500", 0.0),
        ("n1", "500", 300.0),
        ("n2", "500", 0.0),
        ("n2", "500", 300.0),
    ]
    groups = incarnations_of(segments)
    assert [[g.start_ts - T0 for g, _ in grp] for grp in groups] == [[0.0, 0.0], [300.0, 300.0]]
    picked = select_job(segments, "500+1")
    assert (picked.job_id, picked.incarnations, len(picked.guards), len(picked.children)) == ("500", 2, 2, 4)
    assert all(c.guard_done_ts == T0 + 395 for c in picked.children)
    assert select_job(segments, "999").guards == ()
    assert record_belongs({"job_id": "500", "restart_count": 0}, "500", 0)
    assert not record_belongs({"job_id": "500", "restart_count": 0}, "500", 1)
    assert not record_belongs({"job_id": "365", "restart_count": 0}, "367", 0)
    assert record_belongs({"component": "gen"}, "367", 2)  # an old record without ids is not excluded
