"""Every HTTP route of every server the job starts requires the job's token (issue 23), and each listens on one
address, not on every interface.

The servers as they are served — the guard (`Guard.app`), the teacher (`engines.teacher.process.teacher_app` over a real
micro Qwen3 `TorchScoringEngine`), the hf rollout server (`hf_server.rollout_app` over a real `HFRolloutEngine`,
AWEX routes included) and the sglang backend (`sglang_server.sglang_app` over the stand-in Engine of
test_sglang_backend.py) — on real 127.0.0.1 sockets. The routes are enumerated from each app's router, so a
route added later is checked without a change here: without the token (or with a wrong one) each answers 401,
except the bare liveness probe, which answers `{"status": "ok"}` and nothing else; with the token none
answers 401.

Binding: 127.0.0.2 is another loopback address of this host, so a socket bound to 127.0.0.1 only refuses a
connection to 127.0.0.2 while an every-interface socket accepts it. A guard started with `--bind 127.0.0.2`
gives its child MOPD_NODE_ADDR=127.0.0.2, and the child's server (`tests/engines/server_child_prog.py`: `RoleEnv`,
`read_job_token`, `start_app`) listens there only; the weight-sync TCPStore (`engines/tcp_store.py`) listens on
its host only, where torch's own store listens on every interface.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import aiohttp
import pytest
from aiohttp import test_utils, web
from helpers_auth import AUTH, TOKEN, write_run_dir_token
from helpers_models import save_micro_qwen3
from helpers_ports import free_port
from helpers_wait import wait_for
from test_sglang_backend import PORTS, FakeSGLangEngine

from mopd_hpc.engines.rollout.hf_engine import HFRolloutEngine
from mopd_hpc.engines.rollout.hf_server import rollout_app
from mopd_hpc.engines.rollout.http_app import RolloutServer
from mopd_hpc.engines.rollout.server_args import ServerArgs
from mopd_hpc.engines.rollout.sglang_backend import SGLangLaunch
from mopd_hpc.engines.rollout.sglang_server import SGLangRolloutServer, sglang_app
from mopd_hpc.engines.serving import start_app
from mopd_hpc.engines.tcp_store import tcp_store
from mopd_hpc.engines.teacher.http_app import TeacherServer
from mopd_hpc.engines.teacher.process import teacher_app
from mopd_hpc.engines.torch.scoring import TorchScoringEngine
from mopd_hpc.runtime.guard.server import Guard, GuardConfig
from mopd_hpc.runtime.http_auth import (
    AUTH_HEADER,
    LIVENESS_BODY,
    UNAUTHORIZED_BODY,
    authorization_value,
    protect,
)
from mopd_hpc.runtime.ports import LeasePolicy, read_ephemeral_range

TESTS_DIR = Path(__file__).resolve().parent
#: Another loopback address of this host (the whole 127/8 is loopback on Linux).
OTHER_LOOPBACK = "127.0.0.2"
#: Routes each server must have at least (the attack surface of the trial): the enumeration found them.
CONTROL_ROUTES = {
    "guard": {"/spawn", "/kill", "/shutdown", "/ports/reserve", "/status"},
    "teacher": {"/score", "/offload", "/onload", "/reload"},
    "rollout": {
        "/update_weights_from_disk",
        "/init_weights_update_group",
        "/pause_generation",
        "/release_memory_occupation",
        "/awex/init",
        "/server_info",
    },
    "sglang": {"/generate", "/release_memory_occupation", "/server_info", "/model_info"},
}


@pytest.fixture(scope="module")
def micro(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_micro_qwen3(tmp_path_factory.mktemp("auth") / "model", seed=0)


@contextlib.asynccontextmanager
async def served(name: str, micro: Path, tmp: Path) -> AsyncIterator[web.Application]:
    """The app of server `name`, built as the job builds it, behind helpers_auth.TOKEN."""
    if name == "guard":
        policy = LeasePolicy.create(read_ephemeral_range(), 20000, 32000)
        (tmp / "run").mkdir()
        yield Guard(
            GuardConfig.create(tmp / "run", "auth-job", "h", lease_policy=policy, base_env={}), TOKEN
        ).app
    elif name == "teacher":
        engine = TorchScoringEngine.from_pretrained(str(micro), dtype="float32", device="cpu")
        yield teacher_app(TeacherServer(engine, "t", str(micro)), TOKEN)
    elif name == "rollout":
        engine = HFRolloutEngine.load(str(micro), "cpu", "float32")
        server = RolloutServer(ServerArgs(model_path=str(micro), host="127.0.0.1", port=0), engine)
        server.scheduler.start()
        try:
            yield rollout_app(server, TOKEN)
        finally:
            server.scheduler.stop()
    else:
        yield sglang_app(SGLangRolloutServer(SGLangLaunch.from_ports("/m", PORTS), FakeSGLangEngine()), TOKEN)


def routes_of(app: web.Application) -> list[tuple[str, str]]:
    """(method, path) of every route of `app`; every resource must be a plain path (a dynamic one would need
    a value here)."""
    out = []
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        assert "path" in info, f"{route}: not a plain path; extend routes_of with a value for it"
        out.append((route.method, info["path"]))
    return out


async def answer(
    http: aiohttp.ClientSession, base: str, method: str, path: str, headers: dict[str, str]
) -> tuple[int, object, str | None]:
    """(status, JSON body or None, WWW-Authenticate). A POST sends a malformed JSON body: a handler that
    parses it refuses it (400) instead of acting."""
    body = b"{" if method in ("POST", "PUT") else None
    async with http.request(method, base + path, data=body, headers=headers) as resp:
        text = await resp.text()
        data = json.loads(text) if text.strip().startswith(("{", "[")) else None
        return resp.status, data, resp.headers.get("WWW-Authenticate")


@pytest.mark.parametrize("name", ["guard", "teacher", "rollout", "sglang"])
def test_every_route_answers_401_without_the_token(name: str, micro: Path, tmp_path: Path) -> None:
    async def scenario() -> dict[str, list]:
        found: dict[str, list] = {"open": [], "refused": [], "liveness": [], "served": [], "unknown": []}
        async with served(name, micro, tmp_path) as app:
            found["routes"] = routes_of(app)
            async with test_utils.TestServer(app, host="127.0.0.1") as ts, aiohttp.ClientSession() as http:
                base = f"http://127.0.0.1:{ts.port}"
                wrong = {AUTH_HEADER: authorization_value(TOKEN[:-1] + ("x" if TOKEN[-1] != "x" else "y"))}
                for method, path in found["routes"]:
                    for headers in ({}, wrong, {AUTH_HEADER: TOKEN}):  # none, wrong, no "Bearer " scheme
                        status, body, challenge = await answer(http, base, method, path, headers)
                        if path == "/health" and method in ("GET", "HEAD"):
                            found["liveness"].append((method, status, body))
                        elif (status, challenge) == (401, "Bearer") and (
                            body == UNAUTHORIZED_BODY or method == "HEAD"  # a HEAD answer has no body
                        ):
                            found["refused"].append((method, path))
                        else:
                            found["open"].append((method, path, status, body))
                for method in ("GET", "POST"):
                    found["unknown"].append((await answer(http, base, method, "/no/such/route", {}))[0])
                for method, path in found["routes"]:  # with the token every route reaches its handler
                    status, _, _ = await answer(http, base, method, path, AUTH)
                    found["served"].append((method, path, status))
        return found

    found = asyncio.run(scenario())
    routes = found["routes"]
    assert found["open"] == [], f"{name}: routes that answered without the token: {found['open']}"
    assert CONTROL_ROUTES[name] <= {path for _, path in routes}, routes
    others = [(m, p) for m, p in routes if not (p == "/health" and m in ("GET", "HEAD"))]
    assert found["refused"] == [r for r in others for _ in range(3)]
    # the liveness probe says nothing but that the server is up, the same on every server
    assert {(m, s) for m, s, _ in found["liveness"]} == {("GET", 200), ("HEAD", 200)}
    assert all(body == LIVENESS_BODY for m, _, body in found["liveness"] if m == "GET")
    assert found["unknown"] == [401, 401]  # no route list for a caller without the token
    unauthorized = [(m, p, s) for m, p, s in found["served"] if s == 401]
    assert unauthorized == [], f"{name}: routes that refused the token: {unauthorized}"


def test_a_server_without_the_token_check_is_not_served() -> None:
    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_get("/health", health)

    async def scenario() -> None:
        with pytest.raises(ValueError, match=r"no token check: .*protect\(app, token\)"):
            await start_app(app, "127.0.0.1", 0)
        with pytest.raises(ValueError, match="token is empty"):
            protect(web.Application(), "")

    asyncio.run(scenario())


def refused(host: str, port: int) -> bool:
    """True when nothing accepts a TCP connection at (host, port)."""
    with socket.socket() as s:
        s.settimeout(5)
        try:
            s.connect((host, port))
        except ConnectionRefusedError:
            return True
    return False


def test_the_rendezvous_store_listens_on_its_host_only() -> None:
    import torch.distributed as dist

    port = free_port()
    store = tcp_store("127.0.0.1", port, 2, is_master=True, timeout_s=30)
    client = tcp_store("127.0.0.1", port, 2, is_master=False, timeout_s=30)
    client.set("k", "v")
    assert store.get("k") == b"v"
    assert refused(OTHER_LOOPBACK, port)  # not on every interface
    del client, store
    # why the helper exists: torch's own server store listens on every interface, whatever host it is given
    other = free_port()
    plain = dist.TCPStore("127.0.0.1", other, 1, True, timedelta(seconds=30), wait_for_workers=False)
    assert not refused(OTHER_LOOPBACK, other)
    del plain


def test_a_guard_child_serves_on_the_guards_address_only(tmp_path: Path) -> None:
    """mopd-guard --bind 127.0.0.2 spawns a server child: it gets MOPD_NODE_ADDR, binds it, requires the run
    dir's token, and nothing listens on 127.0.0.1 at its port."""
    from mopd_hpc.runtime.guard.client import GuardClient

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_run_dir_token(run_dir)
    env = {k: v for k, v in os.environ.items() if k not in ("MOPD_SECRET_FILE", "SLURMD_NODENAME")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS_DIR), env.get("PYTHONPATH", "")) if p)
    env["MOPD_BACKEND"] = "local"
    argv = [sys.executable, "-m", "mopd_hpc.cli.guard", "--run-dir", str(run_dir), "--job-id", "bindjob"]
    argv += ["--host", "h", "--bind", OTHER_LOOPBACK, "--kill-wait-s", "2"]
    argv += ["--extra-role", "servechild=server_child_prog"]
    log = tmp_path / "guard.err"
    with open(log, "wb") as err:
        guard = subprocess.Popen(
            argv, env=env, stdout=err, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    try:
        record_file = run_dir / "guards" / "h.json"
        wait_for(lambda: record_file.exists() or guard.poll() is not None, 30, "the guard record")
        assert guard.poll() is None, log.read_text()
        record = json.loads(record_file.read_text())
        assert (record["bind"], record["url"]) == (
            OTHER_LOOPBACK,
            f"http://{OTHER_LOOPBACK}:{record['port']}",
        )
        assert refused("127.0.0.1", record["port"])
        client = GuardClient(record["url"], TOKEN, timeout_s=30)
        child = client.spawn("servechild", 0, ports=["http"])
        ready = run_dir / "endpoints" / "servechild-0.json"
        wait_for(ready.exists, 60, f"the server child (stderr: {child['stderr']})")
        served_at = json.loads(ready.read_text())
        port = child["ports"]["http"]
        assert served_at == {
            "node_addr": OTHER_LOOPBACK,
            "bind_host": OTHER_LOOPBACK,
            "advertise_host": OTHER_LOOPBACK,
            "port": port,
        }
        assert refused("127.0.0.1", port)

        async def probe() -> tuple[int, int, int]:
            base = f"http://{OTHER_LOOPBACK}:{port}"
            async with aiohttp.ClientSession() as http:
                async with http.get(base + "/hello") as r:
                    without = r.status
                async with http.get(base + "/hello", headers=AUTH) as r:
                    with_token = r.status
                async with http.get(base + "/health") as r:
                    live = r.status
            return without, with_token, live

        assert asyncio.run(probe()) == (401, 200, 200)
        client.kill("servechild", 0)
        client.shutdown()
        assert guard.wait(timeout=30) == 0
    finally:
        if guard.poll() is None:
            guard.kill()
            guard.wait()
