"""No grandchild survives: a child that starts a `sleep` in a session of its own and a double-forked daemon
(parent gone at once, new session), as SGLang's scheduler and torch's workers do. (a) a kill of the child,
(b) a SIGKILL of the guard (its keeper kills what is left), (c) a SIGKILL of the keeper (the guard kills every
tree at once), (d) the guard's teardown: every process is gone within a bounded time. Real `mopd-guard`s."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import psutil
from helpers_wait import until
from test_guard import RunningGuard, alive, port_free_of_lease, start_guard, stop_guard

from mopd_hpc.launch.local import kill_leftovers

#: After the guard's SIGKILL: the keeper's sweep (SIGTERM, kill_wait_s = 1 s, SIGKILL) plus scheduling slack.
KEEPER_DEADLINE_S = 5.0
#: After the keeper's SIGKILL, or once a kill has answered: the trees die at once.
DEADLINE_S = 2.0


def detached(g: RunningGuard, index: int) -> tuple[dict[str, Any], list[int]]:
    """Spawn a `detached` child; its pids (child, grandchild, daemon), checked to be in other sessions."""
    child = g.spawn_test(index, "detached", ports=["http"])
    info = g.ready(child)
    pids = [info["pid"], info["grandchild"], info["daemon"]]
    assert all(alive(p) for p in pids)
    sessions = {os.getsid(p) for p in pids}
    assert len(sessions) == 3 and info["pid"] in sessions  # three sessions: the group kill misses two
    return child, pids


def guard_pid(g: RunningGuard) -> int:
    return int(json.loads((g.run_dir / "guards" / "testhost.json").read_text())["pid"])


def test_a_kill_of_the_child_kills_its_detached_grandchild_and_daemon(tmp_path: Path) -> None:
    g = start_guard(tmp_path)
    try:
        child, pids = detached(g, 0)
        assert psutil.Process(pids[2]).ppid() == guard_pid(g)  # the orphaned daemon: adopted (subreaper)
        answer = g.client.kill("testchild", 0)
        assert answer["state"] == "exited"
        assert until(lambda: not any(alive(p) for p in pids), DEADLINE_S), [p for p in pids if alive(p)]
        assert port_free_of_lease(child["ports"]["http"])
        signals = [e["signal"] for e in g.events if e.get("index") == 0 and e["event"] == "kill"]
        assert signals == ["SIGTERM"]  # all three ended on the SIGTERM: none needed the SIGKILL
    finally:
        stop_guard(g)


def test_teardown_kills_every_tree(tmp_path: Path) -> None:
    g = start_guard(tmp_path)
    try:
        trees = [detached(g, i)[1] for i in range(2)]
        g.client.shutdown()
        assert g.proc.wait(timeout=30) == 0
        assert until(lambda: not any(alive(p) for t in trees for p in t), DEADLINE_S)
    finally:
        stop_guard(g)


def test_sigkill_of_the_guard_the_keeper_kills_the_detached_processes(tmp_path: Path) -> None:
    g = start_guard(tmp_path, extra_args=["--keeper"])
    try:
        keeper, guard = g.proc.pid, guard_pid(g)
        assert guard != keeper and psutil.Process(guard).ppid() == keeper
        child, pids = detached(g, 0)
        os.kill(guard, signal.SIGKILL)
        assert until(lambda: not any(alive(p) for p in pids), KEEPER_DEADLINE_S), [
            p for p in pids if alive(p)
        ]
        assert g.proc.wait(timeout=KEEPER_DEADLINE_S) == -signal.SIGKILL  # the keeper ends as the guard did
        assert port_free_of_lease(child["ports"]["http"]) and not alive(guard)
    finally:
        stop_guard(g)


def test_sigkill_of_the_keeper_the_guard_kills_every_tree_at_once(tmp_path: Path) -> None:
    g = start_guard(tmp_path, extra_args=["--keeper"])
    try:
        guard = guard_pid(g)
        child, pids = detached(g, 0)
        g.proc.send_signal(signal.SIGKILL)
        g.proc.wait()
        assert until(lambda: not any(alive(p) for p in pids), DEADLINE_S), [p for p in pids if alive(p)]
        assert port_free_of_lease(child["ports"]["http"])
        assert until(lambda: not alive(guard), 10)  # then the guard stops
        assert any(e["event"] == "guard_signal" and e["signal"] == "SIGHUP" for e in g.events)
    finally:
        stop_guard(g)


def test_the_local_backend_kills_what_carries_its_job_id_wherever_it_went(tmp_path: Path) -> None:
    job = f"local-{os.getpid()}-leftover"
    env = {**os.environ, "MOPD_JOB_ID": job}
    stray = subprocess.Popen(["sleep", "1000"], env=env, start_new_session=True)  # as if left by a dead guard
    other = subprocess.Popen(["sleep", "1000"], env={**os.environ, "MOPD_JOB_ID": "local-other"})
    try:
        assert kill_leftovers(job) == 1
        assert stray.wait(timeout=DEADLINE_S) == -signal.SIGKILL
        assert other.poll() is None  # another job's process is not touched
    finally:
        for proc in (stray, other):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
