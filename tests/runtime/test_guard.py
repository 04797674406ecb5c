"""The guard as a real process: auth, registered roles only, spawn/kill of process groups, ports, env, 4xx.

One guard serves the whole module (`mopd-guard` in a subprocess, real sockets, real children). The child
program is `tests/runtime/guard_child_prog.py` (role `testchild`). Signal and teardown tests, which need their
own guard, are in test_guard_signals.py and reuse the harness below.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers_wait import until

from mopd_hpc.records.job_token import create_token_file, read_token_file
from mopd_hpc.runtime.guard.client import (
    GuardBadRequestError,
    GuardClient,
    GuardConflictError,
    GuardForbiddenError,
    GuardUnauthorizedError,
)
from mopd_hpc.runtime.guard.events import read_events
from mopd_hpc.runtime.ports_registry import bind_lease_socket, read_owner_record

TESTS_DIR = Path(__file__).resolve().parent
HOST = "testhost"
#: One job id per pytest worker: a port one worker's guard released may be leased at once by another worker's
#: guard, which `port_free_of_lease` must tell apart from a lease this worker still holds.
JOB = f"j1-{os.getpid()}"


# ---- harness (also used by test_guard_signals.py) ----------------------------------------------------
@dataclass
class RunningGuard:
    proc: subprocess.Popen[bytes]
    run_dir: Path
    work: Path
    client: GuardClient
    out: Path
    err: Path

    @property
    def token(self) -> str:
        return read_token_file(self.run_dir / "guard.token")

    @property
    def events(self) -> list[dict[str, Any]]:
        return read_events(self.run_dir / "events" / f"{HOST}.guard.jsonl")

    def spawn_test(self, index: int, mode: str, **kwargs: Any) -> dict[str, Any]:
        env = {"GUARD_TEST_DIR": str(self.work), "GUARD_TEST_MODE": mode, **kwargs.pop("env", {})}
        return self.client.spawn("testchild", index, env=env, **kwargs)

    def ready(self, child: dict[str, Any]) -> dict[str, Any]:
        path = self.work / f"{child['role']}-{child['index']}.g{child['generation']}.ready"
        assert until(path.exists, 20), f"child never got ready; stderr: {Path(child['stderr']).read_text()}"
        return json.loads(path.read_text())


#: The node's GPUs the module's guard is told it has (its CUDA_VISIBLE_DEVICES): spawns may name only these.
FAKE_NODE_GPUS = "GPU-0a1b2c3d,MIG-GPU-0a1b2c3d/1/0,0,1,2,3"


def start_guard(
    tmp: Path,
    *,
    kill_wait_s: float = 1.0,
    checkpoint_wait_s: float = 3.0,
    extra_args: Sequence[str] = (),
    env_extra: dict[str, str] | None = None,
) -> RunningGuard:
    """A real `mopd-guard` on `tmp/run`; the test child's own keys (GUARD_TEST_*) are on its env allow-list."""
    run_dir, work = tmp / "run", tmp / "work"
    run_dir.mkdir()
    work.mkdir()
    create_token_file(run_dir / "guard.token")
    env = {k: v for k, v in os.environ.items() if k not in ("MOPD_SECRET_FILE", "SLURMD_NODENAME")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS_DIR), env.get("PYTHONPATH", "")) if p)
    env["MOPD_BACKEND"] = "local"
    env.update(env_extra or {})
    out, err = tmp / "guard.out", tmp / "guard.err"
    argv = [sys.executable, "-m", "mopd_hpc.cli.guard", "--run-dir", str(run_dir), "--job-id", JOB]
    argv += ["--host", HOST, "--kill-wait-s", str(kill_wait_s), "--checkpoint-wait-s", str(checkpoint_wait_s)]
    argv += ["--extra-role", "testchild=guard_child_prog", *extra_args]
    argv += ["--allow-env", "GUARD_TEST_DIR", "--allow-env", "GUARD_TEST_MODE"]
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(argv, env=env, stdout=o, stderr=e, stdin=subprocess.DEVNULL)
    guard_file = run_dir / "guards" / f"{HOST}.json"
    if not until(lambda: guard_file.exists() or proc.poll() is not None, 30) or proc.poll() is not None:
        proc.kill()
        pytest.fail(f"guard did not start: {err.read_text()}")
    client = GuardClient.from_run_dir(run_dir, HOST, run_dir / "guard.token", timeout_s=30, retries=2)
    return RunningGuard(proc, run_dir, work, client, out, err)


def stop_guard(g: RunningGuard) -> None:
    if g.proc.poll() is None:
        try:
            g.client.shutdown()
            g.proc.wait(timeout=20)
        except Exception:
            g.proc.kill()
            g.proc.wait()


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()  # [state, ppid, pgrp, ...]


def alive(pid: int) -> bool:
    """A live process (a zombie is dead: it only waits to be reaped)."""
    st = _stat(pid)
    return st is not None and st[0] != "Z"


def group_members(pgid: int) -> list[int]:
    """Live processes whose process group is `pgid`."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None and st[0] != "Z" and int(st[2]) == pgid:
                out.append(int(entry))
    return out


def port_free_of_lease(port: int) -> bool:
    """Whether no lease of this module's guard jobs (`JOB`) holds `port`: its lease socket binds, or the process
    holding it now is another job's (a free_port lease of another pytest-xdist worker may land on a port a guard
    released; tests/helpers_ports.py)."""
    sock = bind_lease_socket(port)
    if sock is not None:
        sock.close()
        return True
    record = read_owner_record(port)
    return record is not None and record.job_id != JOB


def raw(
    url: str, method: str, path: str, body: bytes | None, token: str | None
) -> tuple[int, dict[str, Any]]:
    """One HTTP request with no client logic in between; returns (status, JSON body)."""
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url + path, data=body, headers=headers, method=method)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# ---- tests -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def guard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGuard]:
    g = start_guard(tmp_path_factory.mktemp("guard"), env_extra={"CUDA_VISIBLE_DEVICES": FAKE_NODE_GPUS})
    try:
        yield g
    finally:
        stop_guard(g)


def test_health_is_the_only_open_endpoint(guard: RunningGuard) -> None:
    assert raw(guard.client.url, "GET", "/health", None, None) == (200, {"status": "ok"})
    for method, path, body in [
        ("GET", "/status", None),
        ("POST", "/ports/reserve", b'{"role": "x", "index": 0, "names": ["http"]}'),
        ("POST", "/spawn", b'{"role": "testchild", "index": 90}'),
        ("POST", "/kill", b'{"role": "testchild", "index": 90}'),
        ("POST", "/shutdown", b"{}"),
        ("GET", "/no/such/path", None),
    ]:
        for token in (None, "wrong-token", guard.token + "x", ""):
            status, answer = raw(guard.client.url, method, path, body, token)
            assert (status, answer["error"]) == (401, "unauthorized"), (method, path, token)
    assert guard.client.status(role="testchild", index=90)["children"] == []
    assert guard.proc.poll() is None  # the unauthenticated /shutdown did nothing
    with pytest.raises(GuardUnauthorizedError):
        GuardClient(guard.client.url, "nope", retries=0).status()


def test_unregistered_program_is_403_and_nothing_runs(guard: RunningGuard) -> None:
    before = len(guard.events)
    for role in ("bash", "sh", "python", "evil-role"):
        with pytest.raises(GuardForbiddenError) as info:
            guard.client.spawn(role, 0, env={"X": "1"})
        assert info.value.status == 403 and "not a registered entry point" in info.value.message
    status, answer = raw(guard.client.url, "POST", "/spawn", b'{"role": "/bin/sh", "index": 0}', guard.token)
    assert status == 403 and "/bin/sh" in answer["message"]
    assert guard.events[before:] == []
    assert not list((guard.run_dir / "logs").glob("**/bash-*")) and not list(guard.run_dir.glob("**/sh-0*"))
    assert [c["role"] for c in guard.client.status()["children"] if c["role"] != "testchild"] == []


def test_spawn_then_kill_leaves_no_process_of_the_group_and_frees_ports(guard: RunningGuard) -> None:
    child = guard.spawn_test(1, "grandchild", ports=["http", "nccl"])
    info = guard.ready(child)
    assert info["pid"] == child["pid"] == info["pgid"] == child["pgid"] != os.getpgid(0)
    assert sorted(group_members(child["pgid"])) == sorted([info["pid"], info["grandchild"]])
    ports = child["ports"]
    assert set(ports) == {"http", "nccl"} and len(set(ports.values())) == 2
    for name, port in ports.items():
        record = read_owner_record(port)
        assert record is not None and record.answered
        assert (record.job_id, record.role, record.index, record.name) == (JOB, "testchild", 1, name)
        assert record.child_pid == child["pid"] and record.pid == guard.proc.pid
    killed = guard.client.kill("testchild", 1)
    assert (killed["state"], killed["signal"], killed["released"]) == ("exited", "SIGTERM", ports)
    assert group_members(child["pgid"]) == [] and not alive(info["grandchild"])
    assert all(port_free_of_lease(p) for p in ports.values())
    assert guard.client.kill("testchild", 1)["state"] == "exited"  # idempotent
    absent = guard.client.kill("testchild", 77)
    assert (absent["state"], absent["released"]) == ("absent", {})
    kinds = [(e["event"], e.get("signal")) for e in guard.events if e.get("index") == 1]
    assert kinds == [("spawn", None), ("kill", "SIGTERM"), ("exit", "SIGTERM")]


def test_kill_escalates_to_sigkill_for_a_group_that_ignores_sigterm(guard: RunningGuard) -> None:
    child = guard.spawn_test(2, "stubborn", ports=["http"])
    info = guard.ready(child)
    killed = guard.client.kill("testchild", 2, wait_s=0.3)
    assert killed["signal"] == "SIGKILL" and killed["released"] == child["ports"]
    assert group_members(child["pgid"]) == [] and not alive(info["grandchild"])
    signals = [e["signal"] for e in guard.events if e.get("index") == 2 and e["event"] == "kill"]
    assert signals == ["SIGTERM", "SIGKILL"]


def test_env_values_arrive_intact(guard: RunningGuard) -> None:
    tricky = {
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:128",
        "MOPD_T_WITH_EQUALS": "a=b=c,d=e",
        "MOPD_T_QUOTES": 'it\'s "quoted" `x` $HOME \\n',
        "MOPD_T_NEWLINES": "line1\nline2\r\n\tend\n",
        "MOPD_T_UNICODE": "é,ü;→",
        "MOPD_T_EMPTY": "",
    }
    gpus = ["GPU-0a1b2c3d", "MIG-GPU-0a1b2c3d/1/0", "3"]
    child = guard.spawn_test(3, "envdump", env=tricky, gpus=gpus, ports=["http"])
    path = guard.work / "env-testchild-3.g1.json"
    assert until(path.exists, 20), Path(child["stderr"]).read_text()
    got = json.loads(path.read_text())
    assert {k: got[k] for k in tricky} == tricky
    assert got["CUDA_VISIBLE_DEVICES"] == "GPU-0a1b2c3d,MIG-GPU-0a1b2c3d/1/0,3"
    assert got["MOPD_PORT_HTTP"] == str(child["ports"]["http"])
    assert (got["MOPD_ROLE"], got["MOPD_INDEX"], got["MOPD_GENERATION"]) == ("testchild", "3", "1")
    assert got["MOPD_JOB_ID"] == JOB and got["MOPD_HOST"] == HOST
    with pytest.raises(GuardBadRequestError, match="MOPD_ROLE"):
        guard.spawn_test(4, "envdump", env={"MOPD_ROLE": "actor"})
    with pytest.raises(GuardBadRequestError, match="NUL"):
        guard.spawn_test(4, "envdump", env={"MOPD_BAD": "a\0b"})
    with pytest.raises(GuardBadRequestError, match="invalid"):
        guard.spawn_test(4, "envdump", env={"NOT-AN-ID": "x"})
    with pytest.raises(GuardBadRequestError, match="CUDA_VISIBLE_DEVICES"):
        guard.spawn_test(4, "envdump", env={"CUDA_VISIBLE_DEVICES": "0"}, gpus=["1"])
    assert guard.client.status(role="testchild", index=4)["children"] == []


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "needle"),
    [
        ("POST", "/spawn", b"{not json", 400, "not valid JSON"),
        ("POST", "/spawn", b"[1, 2]", 400, "dictionary"),
        ("POST", "/spawn", b'{"role": "testchild"}', 400, "index"),
        ("POST", "/spawn", b'{"role": "testchild", "index": -1}', 400, "index"),
        ("POST", "/spawn", b'{"role": "testchild", "index": "1"}', 400, "index"),
        ("POST", "/spawn", b'{"role": "testchild", "index": 1, "rogue": 1}', 400, "rogue"),
        ("POST", "/spawn", b'{"role": "testchild", "index": 5, "env": {"A": 1}}', 400, "env.A"),
        ("POST", "/spawn", b'{"role": "testchild", "index": 5, "ports": ["HTTP!"]}', 400, "HTTP!"),
        ("POST", "/ports/reserve", b'{"role": "x", "index": 0, "names": []}', 400, "names"),
        ("POST", "/ports/reserve", b'{"role": "x", "index": 0, "names": ["a", "a"]}', 400, "repeat"),
        ("POST", "/ports/reserve", b'{"role": "Bad Role", "index": 0, "names": ["a"]}', 400, "role"),
        ("POST", "/kill", b'{"role": "testchild", "index": 0, "wait_s": -3}', 400, "wait_s"),
        ("POST", "/shutdown", b'{"checkpoint": "yes"}', 400, "checkpoint"),
        ("GET", "/status?index=abc", None, 400, "integers"),
        ("GET", "/spawn", None, 405, "GET"),
        ("POST", "/nowhere", b"{}", 404, "Not Found"),
        ("POST", "/spawn", b"x" * (2 * 1024 * 1024), 413, "maximum request body size"),
    ],
)
def test_malformed_request_is_4xx_with_a_message_and_the_guard_keeps_serving(
    guard: RunningGuard, method: str, path: str, body: bytes | None, status: int, needle: str
) -> None:
    got, answer = raw(guard.client.url, method, path, body, guard.token)
    assert got == status and needle.lower() in answer["message"].lower(), answer
    assert guard.client.health() and guard.proc.poll() is None
    assert guard.client.reserve("checker", 0, ["http"]) == guard.client.reserve("checker", 0, ["http"])


def test_generations_status_logs_and_conflict(guard: RunningGuard) -> None:
    first = guard.spawn_test(6, "sleep")
    guard.ready(first)
    with pytest.raises(GuardConflictError, match="already_running|is running"):
        guard.spawn_test(6, "sleep")
    guard.client.kill("testchild", 6)
    second = guard.spawn_test(6, "envdump")
    assert (first["generation"], second["generation"]) == (1, 2)
    assert until(lambda: guard.client.status("testchild", 6, 2)["children"][0]["state"] == "exited", 20)
    gen2 = guard.client.status("testchild", 6, 2)["children"]
    assert [(c["generation"], c["exit_code"], c["signal"]) for c in gen2] == [(2, 0, None)]
    both = guard.client.status("testchild", 6)["children"]
    assert [(c["generation"], c["state"]) for c in both] == [(1, "exited"), (2, "exited")]
    logs = guard.run_dir / "logs" / HOST
    assert {p.name for p in logs.glob("testchild-6.*")} == {
        f"testchild-6.g{g}.{s}" for g in (1, 2) for s in ("out", "err")
    }
    exits = [e for e in guard.events if e["event"] == "exit" and e.get("index") == 6]
    assert [(e["generation"], e["exit_code"], e["signal"]) for e in exits] == [
        (1, None, "SIGTERM"),
        (2, 0, None),
    ]
    assert all({"ts", "host", "role", "index", "generation", "pid"} <= set(e) for e in exits)


def test_reserve_release_are_idempotent_per_owner(guard: RunningGuard) -> None:
    a = guard.client.reserve("rollout", 0, ["http", "nccl", "dist_init"])
    assert guard.client.reserve("rollout", 0, ["nccl", "http"]) == {"nccl": a["nccl"], "http": a["http"]}
    b = guard.client.reserve("rollout", 1, ["http"])
    assert b["http"] not in a.values()
    listed = {(p["role"], p["index"], p["name"]): p["port"] for p in guard.client.status()["ports"]}
    assert listed[("rollout", 0, "dist_init")] == a["dist_init"] and listed[("guard", 0, "http")] > 0
    assert guard.client.release("rollout", 0) == a
    with pytest.raises(GuardForbiddenError, match="guard itself"):
        guard.client.release("guard", 0)
    assert guard.client.health()
    assert guard.client.release("rollout", 0) == {}
    assert all(port_free_of_lease(p) for p in a.values())


def test_probe_writes_topology_and_named_ports(guard: RunningGuard) -> None:
    child = guard.client.spawn(
        "probe", 0, env={"MOPD_PROBE_ENV_KEYS": "MOPD_ODD", "MOPD_ODD": "a,b"}, ports=["http"]
    )
    path = guard.run_dir / "probe" / f"{HOST}-probe-0.json"
    assert until(path.exists, 30), Path(child["stderr"]).read_text()
    report = json.loads(path.read_text())
    assert (report["role"], report["index"], report["generation"], report["pid"]) == (
        "probe",
        0,
        1,
        child["pid"],
    )
    assert report["ports"] == child["ports"] and report["env"]["MOPD_ODD"] == "a,b"
    assert report["topology"]["role"] == "probe" and report["topology"]["job_id"] == JOB
    done = guard.client.status("probe", 0)["children"]
    assert until(lambda: guard.client.status("probe", 0)["children"][0]["exit_code"] == 0, 20), done


def test_token_never_appears_in_logs_argv_or_environ(guard: RunningGuard) -> None:
    guard.spawn_test(8, "envdump", env={"MOPD_SOME": "value"})
    assert until((guard.work / "env-testchild-8.g1.json").exists, 20)
    raw(guard.client.url, "POST", "/spawn", b"{broken", guard.token)
    token = guard.token.encode()
    token_file = (guard.run_dir / "guard.token").resolve()
    files = [p for p in guard.run_dir.rglob("*") if p.is_file() and p.resolve() != token_file]
    files += [guard.out, guard.err] + list(guard.work.rglob("*"))
    assert len(files) > 5
    assert [p for p in files if token in p.read_bytes()] == []
    for what in ("cmdline", "environ"):
        assert token not in Path(f"/proc/{guard.proc.pid}/{what}").read_bytes()
    assert token not in repr(guard.client).encode()
