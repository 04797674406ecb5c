"""Children forked from the guard's fork server (runtime/guard/fork_server.py, zygote.py) keep the guarantees of
exec'ed ones: the guard's own child in a session of its own, its environment, log files and leases, its exit
status, its whole tree killed, its death with the guard's; a spawn whose environment differs on a key read at
import is exec'ed instead.

The guard is a real `mopd-guard --fork-role testchild --preload json` (test_guard.py's harness), its test keys
(GUARD_TEST_DIR, GUARD_TEST_MODE=detached) in its own environment so that a `detached` spawn matches the
zygote's environment and forks, while an `envdump` spawn (another GUARD_TEST_MODE) does not.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers_wait import until
from test_guard import RunningGuard, alive, group_members, port_free_of_lease, start_guard, stop_guard

from mopd_hpc.runtime.guard.fork_server import REQUEST_READY_WAIT_S, ForkedProcess, import_env


def _ppid(pid: int) -> int:
    text = Path(f"/proc/{pid}/stat").read_text()
    return int(text[text.rindex(")") + 2 :].split()[1])


def _forking_guard(tmp: Path, preload: str = "json", **env_extra: str) -> RunningGuard:
    env = {"GUARD_TEST_DIR": str(tmp / "work"), "GUARD_TEST_MODE": "detached", **env_extra}
    return start_guard(tmp, extra_args=["--fork-role", "testchild", "--preload", preload], env_extra=env)


@pytest.fixture
def guard(tmp_path: Path) -> Iterator[RunningGuard]:
    g = _forking_guard(tmp_path)
    try:
        yield g
    finally:
        stop_guard(g)


def _spawn_event(g: RunningGuard, index: int) -> dict:
    return next(e for e in g.events if e["event"] == "spawn" and e["index"] == index)


def test_a_forked_child_is_the_guards_own_with_its_env_files_and_leases_and_its_tree_dies_with_it(
    guard: RunningGuard,
) -> None:
    child = guard.spawn_test(0, "detached", ports=["http"])
    info = guard.ready(child)  # written under the stem of its own MOPD_ROLE / MOPD_INDEX / MOPD_GENERATION
    assert _spawn_event(guard, 0)["forked"] is True
    ready = [e for e in guard.events if e["event"] == "fork_server_ready"]
    assert len(ready) == 1 and ready[0]["preloaded"] == ["json"] and ready[0]["pid"] != child["pid"]
    assert info["pid"] == child["pid"] == info["pgid"] == child["pgid"] != os.getpgid(0)  # its own session
    assert os.getsid(child["pid"]) == child["pid"]
    assert _ppid(child["pid"]) == guard.proc.pid  # adopted: the guard's own child
    assert Path(child["stdout"]).is_file() and Path(child["stderr"]).is_file()
    port = child["ports"]["http"]
    assert not port_free_of_lease(port)  # the guard's copy and the child's hold it
    killed = guard.client.kill("testchild", 0)
    assert (killed["state"], killed["signal"]) == ("exited", "SIGTERM")  # Popen's status, from waitpid
    assert group_members(child["pgid"]) == []
    assert not alive(info["grandchild"]) and not alive(info["daemon"])  # the daemon left the session
    assert port_free_of_lease(port)
    second = guard.spawn_test(0, "detached")
    assert second["generation"] == 2 and _spawn_event(guard, 0)["forked"] is True
    assert guard.ready(second)["pid"] == second["pid"]
    assert len([e for e in guard.events if e["event"] == "fork_server_ready"]) == 1  # one zygote per guard


def test_a_spawn_whose_import_environment_differs_is_execed(guard: RunningGuard) -> None:
    child = guard.spawn_test(1, "envdump")  # GUARD_TEST_MODE differs from the zygote's
    dump = guard.work / "env-testchild-1.g1.json"
    assert until(dump.exists, 20), Path(child["stderr"]).read_text()
    assert _spawn_event(guard, 1)["forked"] is False
    env = json.loads(dump.read_text())
    assert (env["MOPD_ROLE"], env["GUARD_TEST_MODE"]) == ("testchild", "envdump")


def test_a_forked_child_dies_with_its_guard(tmp_path: Path) -> None:
    g = _forking_guard(tmp_path)
    info: dict = {}
    try:
        child = g.spawn_test(2, "detached")
        info = g.ready(child)
        zygote = next(e["pid"] for e in g.events if e["event"] == "fork_server_ready")
        g.proc.send_signal(signal.SIGKILL)
        g.proc.wait()
        assert until(lambda: not alive(info["pid"]) and not alive(zygote), 20)  # parent-death signal
    finally:
        stop_guard(g)
        for pid in (info.get("grandchild"), info.get("daemon")):
            if pid and alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_spawn_request_is_execed_when_the_imports_outlast_its_wait_and_later_ones_fork(
    tmp_path: Path,
) -> None:
    """A node whose imports are slower than a request may wait (a cold file system): the request is answered
    with an exec'ed child within REQUEST_READY_WAIT_S, well inside the client's timeout, and the fork server
    goes on importing for the spawns after it."""
    slow_s = REQUEST_READY_WAIT_S + 5
    g = _forking_guard(tmp_path, preload="preload_prog", PRELOAD_SLEEP_S=str(slow_s))
    try:
        started = time.monotonic()
        first = g.spawn_test(3, "detached")
        waited = time.monotonic() - started
        assert REQUEST_READY_WAIT_S - 0.5 < waited < slow_s
        assert _spawn_event(g, 3)["forked"] is False
        assert g.ready(first)["pid"] == first["pid"]
        assert until(lambda: any(e["event"] == "fork_server_ready" for e in g.events), 60)
        ready = next(e for e in g.events if e["event"] == "fork_server_ready")
        assert ready["seconds"] >= slow_s and ready["preloaded"] == ["preload_prog"]
        second = g.spawn_test(4, "detached")
        assert _spawn_event(g, 4)["forked"] is True
        assert g.ready(second)["pid"] == second["pid"]
        assert _ppid(second["pid"]) == g.proc.pid
    finally:
        stop_guard(g)


def test_a_fork_server_that_dies_while_importing_is_said_failed_and_its_spawns_exec(tmp_path: Path) -> None:
    g = _forking_guard(tmp_path, preload="preload_prog", PRELOAD_EXIT="3")
    try:
        child = g.spawn_test(5, "detached")
        assert _spawn_event(g, 5)["forked"] is False
        assert g.ready(child)["pid"] == child["pid"]
        assert until(lambda: any(e["event"] == "fork_server_failed" for e in g.events), 30)
        failed = [e for e in g.events if e["event"] == "fork_server_failed"]
        assert len(failed) == 1 and "did not get ready" in failed[0]["error"], failed
        assert not any(e["event"] == "fork_server_ready" for e in g.events)
    finally:
        stop_guard(g)


def test_the_import_environment_leaves_out_only_the_per_child_keys() -> None:
    env = {"MOPD_ROLE": "actor", "MOPD_PORT_HTTP": "1", "CUDA_VISIBLE_DEVICES": "0", "OMP_NUM_THREADS": "2"}
    assert import_env(env) == {"OMP_NUM_THREADS": "2"}


@pytest.mark.parametrize(
    ("code", "want"), [("raise SystemExit(3)", 3), ("import os; os.kill(os.getpid(), 9)", -9)]
)
def test_a_forked_process_reports_its_status_as_popen_does(code: str, want: int) -> None:
    proc = subprocess.Popen([sys.executable, "-c", code])
    forked = ForkedProcess(proc.pid)
    assert until(lambda: forked.poll() is not None, 20)
    assert forked.returncode == forked.wait() == want
