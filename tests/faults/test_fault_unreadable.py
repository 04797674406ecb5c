"""Fault: the run's own records damaged (a job killed mid-write, garbage, a full disk) — `mopd-logs summarize`
names what it could not read, keeps its exit code (the job's state) and prints no traceback (issue 41,
mopd_hpc/logs/unreadable.py).

Kept: every readable metrics line still counts (the curve around the gap is intact); the job's state and first
failure are those of the undamaged run dir.
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import pytest
from test_logs_summary import RunBuilder

from mopd_hpc.cli import logs_summarize
from mopd_hpc.logs.summary import no_sacct, summarize_run
from mopd_hpc.logs.unreadable import Unreadable, parse_problem, unreadable_files

GARBAGE = [
    b"not json at all\n",
    b'{"step": 61, "ts": 1.0, "loss/total": 0.\n',
    b"\x00\x01\xff\xfe\n",
    b"[1, 2]\n",
]


def _cli(run_dir: Path, json_out: bool) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    args = argparse.Namespace(target=str(run_dir), json=json_out, plot=None, no_sacct=True)
    return logs_summarize.run(args, out=out, err=err, env={}), out.getvalue(), err.getvalue()


def _failed_run(tmp_path: Path) -> Path:
    b = RunBuilder(tmp_path / "run")
    b.guard("n1")
    b.child(
        "n1",
        "actor",
        0,
        1,
        exit_at=100,
        exit_code=1,
        err="Traceback (most recent call last):\nValueError: x\n",
    )
    b.metrics(60)  # 60 good lines, then RunBuilder's own torn last line: line 61, half-written
    return b.write()


@pytest.mark.parametrize("json_out", [False, True])
def test_garbage_appended_to_metrics_is_named_and_the_exit_code_kept(tmp_path: Path, json_out: bool) -> None:
    run_dir = _failed_run(tmp_path)
    before = summarize_run(run_dir, sacct_runner=no_sacct)
    with open(run_dir / "metrics.jsonl", "ab") as fh:
        fh.write(b"\n" + b"".join(GARBAGE))
    after = summarize_run(run_dir, sacct_runner=no_sacct)
    assert after.unreadable == (Unreadable("metrics.jsonl", 5, 61, "half-written"),)
    assert (
        after.unreadable[0].describe() == "metrics.jsonl: 5 unreadable lines (first: line 61, half-written)"
    )
    # what was kept: every good line, the state and the first failure
    assert (after.progress.n_lines, after.progress.last_step) == (60, 59)
    assert after.progress.series == before.progress.series
    assert (after.job.state, after.first_failure.cause.key) == (
        before.job.state,
        before.first_failure.cause.key,
    )
    rc, out, err = _cli(run_dir, json_out)
    assert rc == 1 and "Traceback (most recent call last):\nValueError" not in err and err == ""
    if json_out:
        assert json.loads(out)["unreadable"] == [
            {"file": "metrics.jsonl", "lines": 5, "first_line": 61, "reason": "half-written"}
        ]
    else:
        assert "skipped: metrics.jsonl: 5 unreadable lines (first: line 61, half-written)" in out


def test_damaged_events_and_state_files_are_named(tmp_path: Path) -> None:
    run_dir = _failed_run(tmp_path)
    events = run_dir / "events" / "n1.guard.jsonl"
    lines = events.read_bytes().splitlines(keepends=True)
    events.write_bytes(b"".join(lines[:2]) + b"\x00garbage\xff\n" + b"".join(lines[2:]) + b'{"event": "ex')
    (run_dir / "state" / "job.json").write_bytes(b"")  # a full disk: created, never written
    (run_dir / "state" / "last_signal.json").write_text('{"signal": "USR')
    (run_dir / "eval.json").write_text("[1]")
    got = {u.file: u for u in unreadable_files(run_dir)}
    assert got == {
        "metrics.jsonl": Unreadable("metrics.jsonl", 1, 61, "half-written"),
        "events/n1.guard.jsonl": Unreadable("events/n1.guard.jsonl", 2, 3, "binary bytes"),
        "state/job.json": Unreadable("state/job.json", None, None, "empty"),
        "state/last_signal.json": Unreadable("state/last_signal.json", None, None, "half-written"),
        "eval.json": Unreadable("eval.json", None, None, "not a JSON object"),
    }
    rc, out, err = _cli(run_dir, False)
    assert (rc, err) == (1, "")
    assert "skipped: state/job.json: unreadable (empty)" in out
    assert "skipped: events/n1.guard.jsonl: 2 unreadable lines (first: line 3, binary bytes)" in out
    assert "FAILED" in out  # the child's failure is still found from the readable events


def test_line_reasons() -> None:
    assert parse_problem(b'{"a": 1}\n') == ({"a": 1}, None)
    assert parse_problem(b'{"a": [1, 2') == (None, "half-written")
    assert parse_problem(b'{"a": 1} trailing') == (None, "not JSON")
    assert parse_problem(b"\xff\xfe") == (None, "binary bytes")
    assert parse_problem(b"  \n") == (None, "empty")
    assert parse_problem(b"[" * 100_000 + b"]" * 100_000) == (None, "nested too deep")  # no RecursionError
