"""Every malformed or abusive request to a server of the job gets a 4xx (or a 503 for a connection past the
cap) naming the bound and its limit, never a 500, and the server keeps serving (issue 41,
runtime/http_limits.py, runtime/guard/api.py, runtime/guard/spawn_env.py, runtime/gpus.py).

The guard is test_guard's `guard` fixture (a real `mopd-guard` told it has the GPUs of `FAKE_NODE_GPUS`); the teacher,
rollout and sglang apps are those of test_server_auth (real micro Qwen3 engines, the stand-in sglang Engine)
served on real sockets; the connection bounds are measured on a real socket with short limits.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import test_utils, web
from helpers_auth import AUTH, TOKEN
from test_guard import RunningGuard, guard, raw  # noqa: F401 (guard: the module's guard fixture, its own here)
from test_server_auth import micro, served  # noqa: F401 (micro is the fixture of the served apps)

from mopd_hpc.engines.serving import start_app
from mopd_hpc.runtime.gpus import NodeGpus, gpus_refusal, node_gpus
from mopd_hpc.runtime.http_auth import protect
from mopd_hpc.runtime.http_limits import HttpLimits, json_too_deep, loads_bounded

DEEP = b"[" * 100_000 + b"]" * 100_000


def spawn_body(**fields: object) -> bytes:
    return json.dumps({"role": "testchild", "index": 1, **fields}).encode()


@pytest.mark.parametrize(
    ("body", "status", "needles"),
    [
        (spawn_body(index=10**20), 400, ["index", "65535"]),
        (spawn_body(index=65536), 400, ["index", "65535"]),
        (spawn_body(env={"MOPD_BIG": "x" * 1_000_000}), 400, ["MOPD_BIG", "1000000 bytes", "32768"]),
        (spawn_body(env={f"MOPD_K{i}": "x" * 30_000 for i in range(10)}), 400, ["MAX_ENV_BYTES", "262144"]),
        (spawn_body(env={f"MOPD_K{i}": "" for i in range(300)}), 400, ["300 keys", "256"]),
        (spawn_body(env={"HF_HOME": "/tmp/evil"}), 403, ["HF_HOME", "allow-list"]),
        (DEEP, 400, ["nests deeper than 64", "max_json_depth"]),
        (b'{"role": "testchild", "index": 1, "env": ' + b"{" * 5000 + b"}" * 5000 + b"}", 400, ["64"]),
        (spawn_body(gpus=["../x"]), 400, ["'../x'", "not a device index"]),
        (spawn_body(gpus=[str(i) for i in range(10)]), 400, ["lists 10 GPU(s)", "this node has 6 GPU(s)"]),
        (spawn_body(gpus=[str(i) for i in range(100)]), 400, ["gpus", "64"]),
        (spawn_body(gpus=["7"]), 400, ["'7' is not a GPU of this node", "CUDA_VISIBLE_DEVICES"]),
        (spawn_body(gpus=["GPU-ffff0000"]), 400, ["'GPU-ffff0000' is not a GPU of this node"]),
        (spawn_body(gpus=["1", "1"]), 400, ["'1'", "same GPU"]),
        (spawn_body(gpus=["x" * 200]), 400, ["gpus.0", "128"]),
    ],
)
def test_a_bad_spawn_is_4xx_naming_the_field_and_the_limit(
    guard: RunningGuard,  # noqa: F811 (the fixture imported from test_guard)
    body: bytes,
    status: int,
    needles: list[str],
) -> None:
    got, answer = raw(guard.client.url, "POST", "/spawn", body, guard.token)
    assert got == status, answer
    assert all(n.lower() in answer["message"].lower() for n in needles), answer["message"]
    assert guard.client.status(role="testchild", index=1)["children"] == []  # nothing ran
    assert guard.client.health() and guard.proc.poll() is None
    assert "Traceback" not in guard.err.read_text()


def test_the_guard_spawns_on_a_gpu_of_its_node(guard: RunningGuard) -> None:  # noqa: F811
    child = guard.spawn_test(2, "envdump", gpus=["2", "GPU-0a1b2c3d"])
    assert (child["gpus"], child["state"]) == (["2", "GPU-0a1b2c3d"], "running")


def test_node_gpus_come_from_the_guards_devices_or_the_driver(tmp_path: Path) -> None:
    assert node_gpus({"CUDA_VISIBLE_DEVICES": "3,GPU-aa"}).devices == (("3",), ("GPU-aa",))
    assert node_gpus({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}).devices == ()
    assert node_gpus({}, tmp_path / "absent").devices == ()  # a CPU node: no GPU to give
    for bus, uuid in (("0000:41:00.0", "GPU-bbbb"), ("0000:01:00.0", "GPU-aaaa")):
        (tmp_path / bus).mkdir()
        (tmp_path / bus / "information").write_text(f"Model: \t H100\nGPU UUID: \t {uuid}\nBus Type: PCIe\n")
    node = node_gpus({}, tmp_path)
    assert node.devices == (("0", "GPU-aaaa"), ("1", "GPU-bbbb"))  # PCI order, index and UUID
    assert gpus_refusal(["1", "GPU-aaaa"], node) is None
    assert "same GPU" in (gpus_refusal(["0", "GPU-aaaa"], node) or "")
    cpu_node = NodeGpus((), "none")
    assert "lists 1 GPU(s), but this node has 0" in (gpus_refusal(["0"], cpu_node) or "")
    assert "'../x' is not a device index" in (gpus_refusal(["../x"], cpu_node) or "")  # the token first


def test_json_depth_counts_brackets_outside_strings_only() -> None:
    assert not json_too_deep(
        b'{"a": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}', 2
    )
    assert not json_too_deep(b'{"a": "\\"[[[[", "b": [[1]]}', 3)
    assert json_too_deep(b'{"a": "\\"[[[[", "b": [[[1]]]}', 3)
    assert json_too_deep(DEEP, 64) and not json_too_deep(b"[" * 64 + b"]" * 64, 64)
    with pytest.raises(ValueError, match="deeper than 64"):
        loads_bounded(DEEP)
    assert loads_bounded(b'{"x": [[1], [2]]}') == {"x": [[1], [2]]}


@pytest.mark.parametrize(
    ("name", "path"), [("teacher", "/score"), ("rollout", "/generate"), ("sglang", "/generate")]
)
def test_every_server_refuses_a_deep_body_with_400(name: str, path: str, micro: Path, tmp_path: Path) -> None:  # noqa: F811
    async def scenario() -> tuple[int, dict, int]:
        async with served(name, micro, tmp_path) as app:
            async with test_utils.TestServer(app, host="127.0.0.1") as ts, aiohttp.ClientSession() as http:
                base = f"http://127.0.0.1:{ts.port}"
                async with http.post(base + path, data=DEEP, headers=AUTH) as resp:
                    status, answer = resp.status, await resp.json(content_type=None)
                async with http.get(base + "/health", headers=AUTH) as resp:
                    return status, answer, resp.status

    status, answer, health = asyncio.run(scenario())
    assert (status, answer["error"], health) == (400, "body_too_deep", 200), answer
    assert "nests deeper than 64 levels" in answer["message"]


async def _echo(request: web.Request) -> web.Response:
    return web.json_response(await request.json())


def _partial(port: int, data: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(data)
    return s


def _answer(s: socket.socket, wait_s: float = 5.0) -> tuple[bytes, bool]:
    """(what the server sent on `s` within `wait_s`, whether it closed `s` by then)."""
    s.settimeout(wait_s)
    chunks = []
    try:
        while chunk := s.recv(4096):
            chunks.append(chunk)
    except TimeoutError:
        return b"".join(chunks), False
    return b"".join(chunks), True


def test_header_and_body_timeouts_and_the_connection_cap_keep_the_server_serving() -> None:
    """A server started as every server of the job is (`protect` + `start_app`) with short bounds: half-sent
    heads are closed after the header bound, a half-sent body gets 408 after the body bound, a connection
    past the cap gets 503 at once, and /health answers again as soon as the held connections are gone."""
    limits = HttpLimits(header_timeout_s=0.5, body_timeout_s=0.5, max_connections=8)

    async def scenario() -> dict[str, object]:
        app = web.Application()
        app.router.add_post("/echo", _echo)
        runner, port, _ = await start_app(protect(app, TOKEN, limits), "127.0.0.1", 0, limits=limits)
        out: dict[str, object] = {}
        try:
            auth = f"Authorization: {AUTH['Authorization']}\r\n".encode()
            head = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + auth
            body_late = await asyncio.to_thread(_partial, port, head + b"Content-Length: 10\r\n\r\n[1")
            heads = [await asyncio.to_thread(_partial, port, b"GET /health HTTP/1.1\r\nHo") for _ in range(7)]
            over = await asyncio.to_thread(_partial, port, b"")
            out["over"] = await asyncio.to_thread(_answer, over)
            start = time.monotonic()
            out["heads"] = [await asyncio.to_thread(_answer, s) for s in heads]
            out["closed_after_s"] = time.monotonic() - start
            out["body_late"] = (await asyncio.to_thread(_answer, body_late, 1.5))[0]  # then aiohttp lingers
            async with aiohttp.ClientSession() as http:
                async with http.get(f"http://127.0.0.1:{port}/health") as resp:
                    out["health"] = (resp.status, await resp.json())
                async with http.post(f"http://127.0.0.1:{port}/echo", json=[[1]], headers=AUTH) as resp:
                    out["echo"] = (resp.status, await resp.json())
            for s in (body_late, over, *heads):
                s.close()
        finally:
            await runner.cleanup()
        return out

    out = asyncio.run(scenario())
    over, over_closed = out["over"]  # type: ignore[misc]
    assert over.startswith(b"HTTP/1.1 503 ") and over_closed, over
    assert json.loads(over.split(b"\r\n\r\n", 1)[1])["error"] == "too_many_connections"
    late = out["body_late"]
    assert isinstance(late, bytes) and late.startswith(b"HTTP/1.1 408 "), late
    assert b"within 0.5 s" in late
    assert out["heads"] == [(b"", True)] * 7  # closed, nothing answered: the head never arrived
    assert out["closed_after_s"] < 5  # none is held past the bound (a generous one: the CI is shared)
    assert out["health"] == (200, {"status": "ok"}) and out["echo"] == (200, [[1]])
