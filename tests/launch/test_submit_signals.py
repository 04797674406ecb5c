"""`mopd-submit --local` is quiet and orderly when its reader goes away (`| head -1`) and on Ctrl-C through a
pipe (`| tee`): no traceback, the guard finishes its teardown, no process or lease is left, and the exit code
is the shell's convention (141 for a lost reader, 130 for Ctrl-C). Real subprocesses, probe-only runs."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from helpers_wait import until
from test_local_backend import CONFIGS, REPO, env_for, leases_of, processes_of

from mopd_hpc.logs.summary import no_sacct, summarize_run
from mopd_hpc.runtime.guard.events import read_events
from mopd_hpc.runtime.run_lock import read_holder

HOLD = {"MOPD_PROBE_HOLD_S": "300"}  # the probes would hold 5 min: only a stop ends the job quickly


def submit_argv(run_dir: Path) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "mopd_hpc.cli.submit",
        str(CONFIGS / "local_cpu.yaml"),
        "--local",
        "--probe",
    ]
    return [*argv, "--run-dir", str(run_dir)]


def start_submit(run_dir: Path) -> subprocess.Popen[str]:
    """`mopd-submit --local --probe` of the local CPU config, its probes holding (`HOLD`), stdout and stderr piped."""
    return subprocess.Popen(submit_argv(run_dir), cwd=REPO, env=env_for(**HOLD), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def guard_events(run_dir: Path) -> list[dict]:
    (path,) = (run_dir / "events").glob("*.guard.jsonl")
    return read_events(path)


def assert_clean_end(run_dir: Path, job_id: str, stderr: str) -> None:
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
    assert until(lambda: processes_of(run_dir) == [], 10), processes_of(run_dir)
    assert leases_of(job_id) == []


def test_a_reader_that_closes_early_stops_the_job_quietly(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start_submit(run_dir)
    try:
        assert proc.stdout is not None
        seen = []
        while not any("started probe[3]" in line for line in seen):  # every child runs: mid-job
            line = proc.stdout.readline()
            assert line, "".join(seen)
            seen.append(line)
        proc.stdout.close()  # the reader goes away
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 141, err
    assert_clean_end(run_dir, f"local-{proc.pid}", err)
    events = [e["event"] for e in guard_events(run_dir)]
    signals = [e["signal"] for e in guard_events(run_dir) if e["event"] == "guard_signal"]
    assert signals == ["SIGTERM"]  # stopped as a lost terminal: checkpoint request, then teardown
    assert events[-2:] == ["guard_stop", "guard_exit"]  # the teardown ran to its end, then the guard exited
    assert guard_events(run_dir)[-1]["exit_code"] == 0  # (its keeper's record): it was not SIGKILLed
    assert sum(e == "exit" for e in events) == 4


def test_mopd_submit_piped_into_head_1(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    submit = start_submit(run_dir)
    head = subprocess.Popen(["head", "-1"], stdin=submit.stdout, stdout=subprocess.PIPE, text=True)
    assert submit.stdout is not None
    submit.stdout.close()  # head holds the only read end, as in a shell pipeline
    try:
        first, _ = head.communicate(timeout=120)
        _, err = submit.communicate(timeout=120)
    finally:
        for proc in (submit, head):
            if proc.poll() is None:
                proc.kill()
    assert first.startswith("# warning: ") or first.startswith("rank map of 'local-cpu'"), first
    assert submit.returncode == 141, err
    assert_clean_end(run_dir, f"local-{submit.pid}", err)


def test_ctrl_c_through_tee_ends_with_130_and_a_full_teardown(tmp_path: Path) -> None:
    run_dir, log, err_file, rc_file = (
        tmp_path / "run",
        tmp_path / "out.log",
        tmp_path / "err",
        tmp_path / "rc",
    )
    # `mopd-submit ... | tee out.log` in a shell of its own session: Ctrl-C signals the whole pipeline.
    script = (
        f"{{ {shlex.join(submit_argv(run_dir))} 2>{err_file}; echo $? > {rc_file}; }} | tee {log} >/dev/null"
    )
    shell = subprocess.Popen(["bash", "-c", script], cwd=REPO, env=env_for(**HOLD), start_new_session=True)
    try:
        assert until(lambda: log.exists() and "started probe[3]" in log.read_text(), 120), (
            err_file.read_text()
        )
        job_id = read_holder(run_dir)["job_id"]
        os.killpg(shell.pid, signal.SIGINT)  # Ctrl-C: tee dies, mopd-submit gets it and a closed pipe
        assert until(rc_file.exists, 120), err_file.read_text()
    finally:
        if shell.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(shell.pid, signal.SIGKILL)
        shell.wait()
    err = err_file.read_text()
    assert rc_file.read_text().strip() == "130", err
    assert_clean_end(run_dir, job_id, err)
    events = guard_events(run_dir)
    assert [e["signal"] for e in events if e["event"] == "guard_signal"] == ["SIGINT"]
    assert [e["event"] for e in events[-2:]] == ["guard_stop", "guard_exit"]
    assert (events[-1]["exit_code"], events[-1]["signal"]) == (130, None)  # 128 + SIGINT: exited, not killed
    summary = summarize_run(run_dir, sacct_runner=no_sacct)  # and the summary says a person stopped it
    assert (summary.job.job_id, summary.job.state) == (job_id, "CANCELLED")
    assert (summary.first_failure.cause.key, summary.first_failure.cause.title) == (
        "interrupted",
        "interrupted (Ctrl-C)",
    )
    assert {slot.state for slot in summary.children} == {"killed"}
