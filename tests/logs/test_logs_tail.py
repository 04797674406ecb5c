"""`mopd-logs tail`: prefixes, role/rank filters, last-N lines, following appended lines and new generations."""

from __future__ import annotations

import argparse
import datetime as dt
import io
import os
from pathlib import Path

import pytest

from mopd_hpc.cli import logs_tail
from mopd_hpc.logs.tailing import find_child_logs, follow, line_time, poll_once, print_tail, read_last_lines


def _run_dir(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    for host, role, index in (("n1", "actor", 0), ("n1", "actor", 1), ("n2", "rollout", 0)):
        d = root / "logs" / host
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{role}-{index}.g1.out").write_text("".join(f"{role}{index} out {i}\n" for i in range(30)))
        (d / f"{role}-{index}.g1.err").write_text(f"{role}{index} err\n")
    (root / "logs" / "batch.1.log").write_text("not a child log\n")
    return root


def _args(run_dir: Path, **kw) -> argparse.Namespace:
    base = {"run_dir": str(run_dir), "role": None, "rank": None, "lines": 20, "follow": False, "poll_s": 0.0}
    return argparse.Namespace(**{**base, **kw})


def test_prefixes_and_filters(tmp_path: Path) -> None:
    root = _run_dir(tmp_path)
    assert len(find_child_logs(root)) == 6
    out = io.StringIO()
    assert logs_tail.run(_args(root, role="actor", rank=1, lines=3), out=out) == 0
    lines = out.getvalue().splitlines()
    assert sorted(lines) == sorted(
        [
            "[n1 actor-1] actor1 out 27",
            "[n1 actor-1] actor1 out 28",
            "[n1 actor-1] actor1 out 29",
            "[n1 actor-1] actor1 err",
        ]
    )
    out = io.StringIO()
    logs_tail.run(_args(root, role="rollout"), out=out)
    assert all(line.startswith("[n2 rollout-0] ") for line in out.getvalue().splitlines())
    assert len(out.getvalue().splitlines()) == 21
    err = io.StringIO()
    assert logs_tail.run(_args(root, role="teacher"), out=io.StringIO(), err=err) == 1
    assert "no child logs" in err.getvalue()
    assert read_last_lines(root / "logs" / "n1" / "actor-0.g1.out", 2) == ["actor0 out 28", "actor0 out 29"]


def test_follow_prints_appended_lines_and_new_generations(tmp_path: Path) -> None:
    root = _run_dir(tmp_path)
    out = io.StringIO()
    offsets = print_tail(find_child_logs(root, role="actor", rank=0), io.StringIO(), 0)
    polls = []

    def sleep(_s: float) -> None:
        polls.append(1)
        if len(polls) == 1:
            with open(root / "logs" / "n1" / "actor-0.g1.err", "a") as fh:
                fh.write("new line\npartial")
        elif len(polls) == 2:
            with open(root / "logs" / "n1" / "actor-0.g1.err", "a") as fh:
                fh.write(" done\n")
            (root / "logs" / "n1" / "actor-0.g2.err").write_text("restarted\n")
            (root / "logs" / "n1" / "actor-1.g2.err").write_text("other rank\n")

    follow(
        root, out, offsets, role="actor", rank=0, poll_s=0, should_stop=lambda: len(polls) >= 3, sleep=sleep
    )
    assert out.getvalue().splitlines() == [
        "[n1 actor-0] new line",
        "[n1 actor-0] partial done",
        "[n1 actor-0.g2] restarted",
    ]


def test_unknown_role_is_a_usage_error_naming_the_known_roles(tmp_path: Path) -> None:
    root = _run_dir(tmp_path)
    (root / "logs" / "n3").mkdir()
    (root / "logs" / "n3" / "reward-0.g1.out").write_text("a role of this run only\n")
    for follow_flag in (False, True):
        out, err = io.StringIO(), io.StringIO()
        assert logs_tail.run(_args(root, role="actors", follow=follow_flag), out=out, err=err) == 2
        assert out.getvalue() == ""
        assert err.getvalue() == (
            "mopd-logs tail: --role 'actors' is not a known role: expected one of "
            "actor, probe, reward, rollout, teacher\n"
        )
    out = io.StringIO()
    assert logs_tail.run(_args(root, role="reward"), out=out) == 0
    assert out.getvalue() == "[n3 reward-0] a role of this run only\n"


def _local(text: str) -> float:
    return dt.datetime.strptime(text, "%Y-%m-%d %H:%M:%S.%f").timestamp()


def test_line_time_formats() -> None:
    assert line_time("2026-11-30 00:55:09,592 INFO x", 2000) == _local("2026-11-30 00:55:09.592")
    assert line_time("2026-11-30T00:55:09.5 x", 2000) == _local("2026-11-30 00:55:09.5")
    assert line_time("[W1130 00:46:19.091050865 socket.cpp:207] x", 2026) == pytest.approx(
        _local("2026-11-30 00:46:19.091051"), abs=1e-5
    )
    assert line_time("done: 2500 steps", 2026) is None and line_time("2026-13-40 00:00:00 x", 2026) is None


def test_tail_merges_children_by_timestamp(tmp_path: Path) -> None:
    """Interleaved timestamps across three files come out in time order; an untimestamped line stays after
    the line before it in its file, leading ones take the file's first time; a file without timestamps
    sits at its modification time; equal times keep file (mtime) order."""
    root = tmp_path / "run"
    n1, n2 = root / "logs" / "n1", root / "logs" / "n2"
    n1.mkdir(parents=True)
    n2.mkdir(parents=True)
    (n1 / "actor-0.g1.err").write_text(
        "Loading weights: 100%\n"
        "2026-11-30 00:46:16,100 INFO a1\n"
        "2026-11-30 00:46:19,000 INFO a2\n"
        "  continuation of a2\n"
        "2026-11-30 00:55:09,500 INFO a3\n"
    )
    (n2 / "rollout-0.g1.err").write_text(
        "2026-11-30 00:46:18,000 INFO r1\n"
        "[W1130 00:46:19.500000000 socket.cpp:207] r2\n"
        "2026-11-30 00:55:09,500 INFO r3\n"
    )
    out_file = n1 / "actor-0.g1.out"
    out_file.write_text("eval table\ndone: 2500 steps\n")
    t_out = _local("2026-11-30 00:50:00.0")
    os.utime(out_file, (t_out, t_out))
    os.utime(n1 / "actor-0.g1.err", (t_out - 10, t_out - 10))  # older mtime: first among equal times
    os.utime(n2 / "rollout-0.g1.err", (t_out - 5, t_out - 5))
    out = io.StringIO()
    assert logs_tail.run(_args(root, lines=20), out=out) == 0
    assert out.getvalue().splitlines() == [
        "[n1 actor-0] Loading weights: 100%",
        "[n1 actor-0] 2026-11-30 00:46:16,100 INFO a1",
        "[n2 rollout-0] 2026-11-30 00:46:18,000 INFO r1",
        "[n1 actor-0] 2026-11-30 00:46:19,000 INFO a2",
        "[n1 actor-0]   continuation of a2",
        "[n2 rollout-0] [W1130 00:46:19.500000000 socket.cpp:207] r2",
        "[n1 actor-0] eval table",
        "[n1 actor-0] done: 2500 steps",
        "[n1 actor-0] 2026-11-30 00:55:09,500 INFO a3",
        "[n2 rollout-0] 2026-11-30 00:55:09,500 INFO r3",
    ]


def test_poll_merges_new_lines_by_time(tmp_path: Path) -> None:
    root = _run_dir(tmp_path)
    logs = find_child_logs(root, role="actor")
    offsets = print_tail(logs, io.StringIO(), 0)
    with open(root / "logs" / "n1" / "actor-1.g1.err", "a") as fh:
        fh.write("2026-11-30 00:00:01,000 b1\n2026-11-30 00:00:03,000 b2\n")
    with open(root / "logs" / "n1" / "actor-0.g1.err", "a") as fh:
        fh.write("2026-11-30 00:00:02,000 a1\nno time: after a1\n")
    out, last_time = io.StringIO(), {}
    assert poll_once(logs, offsets, {}, out, last_time, now=0.0) == 4
    assert out.getvalue().splitlines() == [
        "[n1 actor-1] 2026-11-30 00:00:01,000 b1",
        "[n1 actor-0] 2026-11-30 00:00:02,000 a1",
        "[n1 actor-0] no time: after a1",
        "[n1 actor-1] 2026-11-30 00:00:03,000 b2",
    ]
    assert last_time[root / "logs" / "n1" / "actor-0.g1.err"] == _local("2026-11-30 00:00:02.0")


def test_tail_into_a_closed_pipe_stops_quietly(tmp_path: Path) -> None:
    """`mopd-logs tail -n 20000 RUN | head -1` (more than a pipe buffer): no BrokenPipeError traceback, exit
    141 (128 + SIGPIPE)."""
    import subprocess
    import sys

    log = tmp_path / "logs" / "n1" / "actor-0.g1.err"
    log.parent.mkdir(parents=True)
    log.write_text("".join(f"2026-11-30 00:00:{i % 60:02d},000 INFO x: line {i}\n" for i in range(20000)))
    proc = subprocess.Popen(
        [sys.executable, "-m", "mopd_hpc.cli.logs", "tail", "-n", "20000", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().startswith("[n1 actor-0] ")
    proc.stdout.close()
    assert proc.wait(timeout=60) == 141
    assert "Traceback" not in proc.stderr.read()
