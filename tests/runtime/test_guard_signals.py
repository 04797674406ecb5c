"""The guard's end of life: SIGKILL (parent-death signal), SIGUSR2/SIGTERM (checkpoint, then teardown),
`POST /shutdown`, and a refused start on a readable token file. Each test runs its own `mopd-guard`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_wait import until
from test_guard import HOST, alive, group_members, port_free_of_lease, start_guard, stop_guard

from mopd_hpc.runtime.guard.client import GuardConflictError
from mopd_hpc.runtime.signals import EXIT_GUARD_START_FAILED

#: DESIGN.md §4 / issue 4: after the guard is SIGKILLed, no child may be left after this long.
ORPHAN_DEADLINE_S = 2.0


def test_guard_sigkill_leaves_no_orphan_and_no_held_port(tmp_path: Path) -> None:
    g = start_guard(tmp_path)
    try:
        children = [g.spawn_test(i, "sleep", ports=["http"]) for i in range(2)]
        pids = [g.ready(c)["pid"] for c in children]
        ports = [c["ports"]["http"] for c in children] + [g.client.url.rsplit(":", 1)[1]]
        g.proc.send_signal(signal.SIGKILL)
        g.proc.wait()
        assert until(lambda: not any(alive(p) for p in pids), ORPHAN_DEADLINE_S)
        assert all(port_free_of_lease(int(p)) for p in ports)
    finally:
        stop_guard(g)


def test_sigusr2_asks_children_to_checkpoint_then_tears_down(tmp_path: Path) -> None:
    g = start_guard(tmp_path, checkpoint_wait_s=10)
    try:
        children = [g.spawn_test(i, "grandchild", ports=["http", "nccl"]) for i in range(2)]
        infos = [g.ready(c) for c in children]
        g.client.reserve("rollout", 0, ["http"])
        leased = [p for c in children for p in c["ports"].values()]
        g.proc.send_signal(signal.SIGUSR2)
        assert g.proc.wait(timeout=30) == 0
        for info in infos:  # each child got USR2 and exited by itself (no SIGTERM was needed)
            assert (g.work / f"testchild-{infos.index(info)}.g1.usr2").read_text() == str(info["pid"])
            assert group_members(info["pgid"]) == [] and not alive(info["grandchild"])
        assert all(port_free_of_lease(p) for p in leased)
        assert not (g.run_dir / "guards" / f"{HOST}.json").exists()
        events = g.events
        assert ("guard_signal", "SIGUSR2") in [(e["event"], e.get("signal")) for e in events]
        exits = sorted((e["index"], e["exit_code"]) for e in events if e["event"] == "exit")
        assert exits == [(0, 0), (1, 0)]
        assert [e["signal"] for e in events if e["event"] == "kill"] == ["SIGUSR2", "SIGUSR2"]
        assert events[-1]["event"] == "guard_stop"
    finally:
        stop_guard(g)


def test_sigterm_waits_a_bounded_time_then_kills_a_child_that_ignores_usr2(tmp_path: Path) -> None:
    g = start_guard(tmp_path, checkpoint_wait_s=0.5, kill_wait_s=0.5)
    try:
        child = g.spawn_test(0, "stubborn", ports=["http"])
        info = g.ready(child)
        g.proc.send_signal(signal.SIGTERM)
        assert g.proc.wait(timeout=30) == 0
        assert group_members(info["pgid"]) == [] and not alive(info["grandchild"])
        assert port_free_of_lease(child["ports"]["http"])
        kills = [e["signal"] for e in g.events if e["event"] == "kill"]
        assert kills == ["SIGUSR2", "SIGTERM", "SIGKILL"]
    finally:
        stop_guard(g)


def test_shutdown_endpoint_tears_down_and_refuses_new_spawns_meanwhile(tmp_path: Path) -> None:
    g = start_guard(tmp_path, kill_wait_s=5)
    try:
        child = g.spawn_test(0, "stubborn")  # ignores SIGTERM: teardown lasts kill_wait_s
        info = g.ready(child)
        g.client.shutdown()
        with pytest.raises(GuardConflictError) as refused:
            g.spawn_test(1, "sleep")
        assert refused.value.kind == "shutting_down"
        assert g.proc.wait(timeout=30) == 0
        assert group_members(info["pgid"]) == []
        assert g.events[-1]["event"] == "guard_stop"
        assert not (g.work / "testchild-1.g1.ready").exists()
    finally:
        stop_guard(g)


def test_guard_refuses_a_token_file_others_can_read(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    token_file = run_dir / "guard.token"
    token_file.write_text("s3cr3t-token-value\n")
    token_file.chmod(0o644)
    argv = [sys.executable, "-m", "mopd_hpc.cli.guard", "--run-dir", str(run_dir), "--job-id", "j"]
    done = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "MOPD_SECRET_FILE"},
    )
    assert done.returncode == EXIT_GUARD_START_FAILED
    assert "0644" in done.stderr and "chmod 600" in done.stderr
    assert "s3cr3t" not in done.stderr + done.stdout
    assert not (run_dir / "guards").exists()
