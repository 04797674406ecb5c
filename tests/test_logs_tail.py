"""`mopd-logs tail`: prefixes, role/rank filters, last-N lines, following appended lines and new generations."""

from __future__ import annotations

import argparse
import io
from pathlib import Path

from mopd_hpc.cli import logs_tail
from mopd_hpc.logs.tailing import find_child_logs, follow, print_tail, read_last_lines


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
