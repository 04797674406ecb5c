"""Binary frames (`engines/frames/codec.py`, `over_http.py`): bitwise round trips, safetensors compatibility, and
refusals of malformed or oversized bodies, over real aiohttp sockets where HTTP is involved."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import torch
from aiohttp import web
from helpers_ports import free_port
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from mopd_hpc.engines.frames import codec as wire
from mopd_hpc.engines.frames.codec import CONTENT_TYPE, WireError, decode, encode
from mopd_hpc.engines.frames.over_http import FRAME_HEADERS, accepts_frame, read_frame, send_frame


def bits(t: torch.Tensor) -> bytes:
    """The tensor's raw bytes (C order): equal bits, not equal values (NaN, -0.0 included)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    values = torch.randn(5, 7, generator=g)
    values[0, :3] = torch.tensor([float("-inf"), float("nan"), -0.0])
    return {
        "ids64": torch.randint(0, 151_936, (4, 6), generator=g, dtype=torch.int64),
        "ids32": torch.randint(-(2**31), 2**31 - 1, (9,), generator=g, dtype=torch.int32),
        "f32": values,
        "bf16": torch.randn(3, 5, 2, generator=g).to(torch.bfloat16),
        "f32_strided": torch.randn(6, 4, generator=g).t(),  # not contiguous
        "scalar": torch.tensor(3.25, dtype=torch.float64),
        "empty": torch.zeros(0, 64, dtype=torch.float32),
        "mask": torch.tensor([True, False, True]),
        "f16": torch.randn(3, generator=g).half(),
        "u8": torch.arange(7, dtype=torch.uint8),
    }


def test_round_trip_every_dtype_is_bitwise_and_zero_copy():
    tensors = sample_tensors()
    body = encode(tensors, {"teacher_id": "t1", "k": 64, "nested": {"a": [1, None]}})
    frame = decode(body)
    assert frame.meta == {"teacher_id": "t1", "k": 64, "nested": {"a": [1, None]}}
    assert list(frame.tensors) != [] and set(frame.tensors) == set(tensors)
    for name, t in tensors.items():
        got = frame.tensors[name]
        assert (got.dtype, got.shape) == (t.dtype, t.shape), name
        assert bits(got) == bits(t), name
    assert frame.payload_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    base = torch.frombuffer(body, dtype=torch.uint8).data_ptr()
    for name, got in frame.tensors.items():  # views into the body, each aligned to its element size
        if got.numel():
            assert base <= got.data_ptr() < base + len(body), name
            assert got.data_ptr() % got.element_size() == 0, name
    read_only = decode(bytes(body))  # a bytes body is copied once, never aliased
    assert bits(read_only.tensors["f32"]) == bits(tensors["f32"])
    assert not (base <= read_only.tensors["f32"].data_ptr() < base + len(body))


def test_frames_are_safetensors_both_ways():
    tensors = sample_tensors()
    body = encode(tensors, {"x": 1})
    theirs = st_load(bytes(body))
    assert all(bits(theirs[n]) == bits(t) for n, t in tensors.items())
    saved = st_save({n: t.contiguous() for n, t in tensors.items()}, metadata={wire.META_KEY: '{"y": 2}'})
    frame = decode(saved)
    assert frame.meta == {"y": 2}
    assert all(bits(frame.tensors[n]) == bits(t) for n, t in tensors.items())


def test_packed_tensors_and_streamed_chunks_equal_one_buffer():
    g = torch.Generator().manual_seed(1)
    padded = torch.randn(4, 9, 3, generator=g)
    padded[1, 0, 2] = float("-inf")
    padded[2, 4, 0] = float("nan")
    ids = torch.randint(0, 1000, (4, 9, 3), generator=g)
    lengths = [5, 0, 9, 2]  # a row of no tokens: a zero-length part
    tensors = {
        "ids": wire.Packed(tuple(ids[b, :n] for b, n in enumerate(lengths)), torch.int32),
        "vals": wire.Packed(tuple(padded[b, :n] for b, n in enumerate(lengths)), torch.float32, -7.0),
        "raw": wire.Packed(tuple(padded[b, :n] for b, n in enumerate(lengths)), torch.float32),
        "lengths": torch.tensor(lengths),
    }
    frame = wire.layout(tensors, {"m": 1})
    whole = bytes(frame.encode())
    for chunk_bytes in (4, 20, 1 << 20):  # pieces that split parts, and one that holds them all
        assert b"".join(bytes(c) for c in frame.chunks(chunk_bytes)) == whole
    got = decode(whole)
    real = torch.cat([padded[b, :n] for b, n in enumerate(lengths)])
    assert torch.equal(got.tensors["ids"], torch.cat([ids[b, :n] for b, n in enumerate(lengths)]).int())
    assert bits(got.tensors["raw"]) == bits(real)  # -inf and NaN kept
    assert bits(got.tensors["vals"]) == bits(torch.nan_to_num(real, nan=-7.0, posinf=-7.0, neginf=-7.0))
    assert frame.size == len(whole) and got.meta == {"m": 1}
    with pytest.raises(WireError, match=r"Packed parts of shapes \[\[2, 3\], \[2, 4\]\]"):
        wire.Packed((torch.zeros(2, 3), torch.zeros(2, 4)), torch.float32)


def test_pool_reuses_a_buffer_only_once_nothing_reads_it():
    import gc

    from mopd_hpc.engines.frames.buffer_pool import BufferPool

    pool = BufferPool(keep=1)
    first = pool.lend(64)
    first[:] = bytes(range(64))
    alive = torch.frombuffer(first, dtype=torch.uint8)[8:16]  # a tensor view keeps the buffer lent
    address = alive.data_ptr() - 8
    del first
    gc.collect()
    assert pool.idle_bytes == 0
    second = pool.lend(64)  # a new buffer: the first is still read through `alive`
    assert torch.frombuffer(second, dtype=torch.uint8).data_ptr() != address
    assert alive.tolist() == list(range(8, 16))
    del alive, second
    gc.collect()
    assert pool.idle_bytes == 64  # keep=1: one idle buffer held
    third = pool.lend(32)  # the smallest idle buffer that fits is reused
    assert len(third) == 32 and pool.idle_bytes == 0
    frame = wire.layout({"x": torch.arange(10, dtype=torch.int64)})
    pieces = list(frame.chunks(16, pool))  # pieces held at once get their own buffers
    assert b"".join(bytes(p) for p in pieces) == bytes(frame.encode())
    with pytest.raises(ValueError, match="keep=-1"):
        BufferPool(keep=-1)


def test_encode_refuses_what_it_cannot_carry():
    with pytest.raises(WireError, match=r"tensor 'c' has dtype torch.complex64; expected one of"):
        encode({"c": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(WireError, match="meta is not JSON-serializable"):
        encode({}, {"x": object()})
    assert decode(encode({}, {"lp": [float("-inf"), None]})).meta == {"lp": [float("-inf"), None]}
    with pytest.raises(WireError, match="tensor name '__metadata__'"):
        encode({"__metadata__": torch.zeros(1)})
    with pytest.raises(WireError, match="tensor 'l' is list; expected a torch.Tensor"):
        encode({"l": [1.0]})  # type: ignore[dict-item]


def _frame_with_header(header: dict, data: bytes) -> bytes:
    head = json.dumps(header).encode()
    return len(head).to_bytes(8, "little") + head + data


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda b: b[:5], r"truncated frame: 5 bytes; expected at least 8"),
        (lambda b: b[:40], r"truncated frame: the header is \d+ bytes but only 32 follow"),
        (lambda b: b[:-1], r"truncated frame: tensor 'x' needs data bytes \[0, 24\) but the frame holds 23"),
        (lambda b: bytes(b) + b"\0", r"1 bytes after the last tensor"),
        (lambda b: (2**40).to_bytes(8, "little") + bytes(b[8:]), r"bad frame header: length 1099511627776"),
        (lambda b: (6).to_bytes(8, "little") + b"{nope}", r"bad frame header: not UTF-8 JSON"),
        (lambda b: _frame_with_header([1], b""), r"bad frame header: a JSON list; expected an object"),
        (
            lambda b: _frame_with_header(
                {"x": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}}, b"ab"
            ),
            r"tensor 'x': dtype 'F8_E4M3' not allowed; expected one of \['BF16', ",
        ),
        (
            lambda b: _frame_with_header(
                {"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8
            ),
            r"tensor 'x' data_offsets \[0, 8\] for F32 \[3\]; expected end - begin = 12 bytes",
        ),
        (
            lambda b: _frame_with_header({"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}, b""),
            r"tensor 'x' shape \[-1\]; expected a list of ints >= 0",
        ),
        (
            lambda b: _frame_with_header(
                {
                    "x": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                    "y": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]},
                },
                b"\0" * 6,
            ),
            r"tensor 'y' at data bytes \[2, 6\) overlaps the tensor before it",
        ),
        (
            lambda b: _frame_with_header(
                {"x": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}}, b"\0" * 4
            ),
            r"tensor 'x' at data bytes \[2, 4\) leaves a hole at \[0, 2\)",
        ),
        (
            lambda b: _frame_with_header({"__metadata__": {"mopd.meta": "[1]"}}, b""),
            r"meta is a JSON list; expected an object",
        ),
        (
            lambda b: _frame_with_header({"x": {"dtype": "U8", "shape": [1]}}, b"\0"),
            r"tensor 'x' is \{'dtype': 'U8', 'shape': \[1\]\}; expected dtype, shape, data_offsets",
        ),
    ],
)
def test_malformed_frames_are_refused_naming_the_fault(make, needle):
    good = encode({"x": torch.arange(6, dtype=torch.float32)})
    assert bits(decode(good).tensors["x"]) == bits(torch.arange(6, dtype=torch.float32))
    with pytest.raises(WireError, match=needle):
        decode(make(good))


def test_max_bytes_and_tensor_checks():
    body = encode({"x": torch.zeros(100, dtype=torch.int64)})
    with pytest.raises(
        WireError, match=rf"frame is {len(body)} bytes; max_body_bytes is 100: send fewer rows"
    ):
        decode(body, max_bytes=100)
    frame = decode(body)
    assert frame.tensor("x", (torch.int64,), 1).shape == (100,)
    with pytest.raises(WireError, match=r"tensor 'x' is I64 of shape \[100\]; expected I32 with 2 dims"):
        frame.tensor("x", (torch.int32,), 2)
    with pytest.raises(WireError, match=r"frame has no tensor 'y' \(has \['x'\]\)"):
        frame.tensor("y", (torch.int64,), 1)


async def _echo_server(max_bytes: int) -> tuple[web.AppRunner, str]:
    """A real aiohttp server whose /echo reads a frame (bounded) and answers it back doubled."""

    async def echo(request: web.Request) -> web.Response:
        try:
            frame = await read_frame(request, max_bytes)
        except WireError as err:
            return web.json_response({"error": str(err)}, status=400)
        doubled = {n: t * 2 for n, t in frame.tensors.items()}
        if accepts_frame(request):
            return await send_frame(request, wire.layout(doubled, dict(frame.meta) | {"echo": True}))
        return web.json_response({n: t.tolist() for n, t in doubled.items()})

    app = web.Application(client_max_size=max_bytes)
    app.router.add_post("/echo", echo)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}/echo"


def test_http_round_trip_and_body_limits_over_a_real_socket():
    async def scenario():
        runner, url = await _echo_server(max_bytes=4096)
        try:
            x = torch.arange(100, dtype=torch.float32) / 3
            async with aiohttp.ClientSession() as session:
                async with session.post(url, data=encode({"x": x}, {"k": 1}), headers=FRAME_HEADERS) as resp:
                    assert resp.status == 200 and resp.content_type == CONTENT_TYPE
                    back = await read_frame(resp, max_bytes=4096)
                assert bits(back.tensors["x"]) == bits(x * 2) and back.meta == {"k": 1, "echo": True}
                async with session.post(url, data=encode({"x": x})) as resp:  # no Accept: JSON back
                    assert resp.content_type == "application/json"
                    assert (await resp.json())["x"] == (x * 2).tolist()
                big = encode({"x": torch.zeros(2000, dtype=torch.float32)})
                async with session.post(url, data=big, headers=FRAME_HEADERS) as resp:
                    assert resp.status == 400
                    assert (
                        f"body is {len(big)} bytes (Content-Length); max_body_bytes is 4096"
                        in (await resp.json())["error"]
                    )
                async with session.post(
                    url, data=bytes(encode({"x": x}))[:-4], headers=FRAME_HEADERS
                ) as resp:
                    assert (
                        resp.status == 400 and "truncated frame: tensor 'x'" in (await resp.json())["error"]
                    )
                async with session.post(url, data=encode({"x": x}), headers=FRAME_HEADERS) as resp:
                    with pytest.raises(WireError, match="max_body_bytes is 64"):
                        await read_frame(resp, max_bytes=64)  # the client's bound
        finally:
            await runner.cleanup()

    asyncio.run(scenario())


def test_large_answers_go_socket_to_buffer_and_equal_one_encoded_buffer(monkeypatch):
    """A large answer leaves the server from the tensors' own memory and lands in the client's buffer
    straight from the socket (`send_frame` / `read_frame` direct paths): its bytes equal `encode`'s, the
    next request on the session gets a new connection, a small answer comes through aiohttp and keeps its
    connection, and an answer cut short is refused naming both counts."""
    from mopd_hpc.engines.frames import over_http as wire_http
    from mopd_hpc.engines.frames.buffer_pool import BufferPool

    g = torch.Generator().manual_seed(3)
    vals = torch.randn(3, 1500, 64, generator=g)  # 384 KB per row and tensor
    vals[1, 5, 7] = float("-inf")  # row 1 needs the floor: copied; rows 0 and 2 sent as they are
    ids = torch.randint(0, 151_936, (3, 1500, 64), generator=g)  # int64 -> int32: copied
    lengths = [1500, 1400, 1500]

    def tensors(rows: list[int]) -> dict[str, torch.Tensor | wire.Packed]:
        return {
            "vals": wire.Packed(tuple(vals[b, : lengths[b]] for b in rows), torch.float32, -1e30),
            "ids": wire.Packed(tuple(ids[b, : lengths[b]] for b in rows), torch.int32),
            "plain": vals[rows[0]].reshape(-1),
        }

    calls = {"send": 0, "recv": 0}
    real_send, real_recv = wire_http._send_all, wire_http._recv_into

    def send(sock, batches):
        calls["send"] += 1
        real_send(sock, batches)

    def recv(sock, out, pos):
        calls["recv"] += 1
        return real_recv(sock, out, pos)

    monkeypatch.setattr(wire_http, "_send_all", send)
    monkeypatch.setattr(wire_http, "_recv_into", recv)
    connections: list[asyncio.Transport] = []  # kept alive: the id of a freed one may be reused

    async def answer(request: web.Request) -> web.StreamResponse:
        connections.append(request.transport)
        if "small" in request.query:
            return await send_frame(request, wire.layout({"x": torch.arange(10, dtype=torch.int64)}))
        rows = [int(r) for r in request.query["rows"].split(",")]
        frame = wire.layout(tensors(rows), {"rows": rows})
        if "cut" in request.query:  # a server that dies mid-answer: declares the size, sends half
            resp = web.StreamResponse(headers={"Content-Type": CONTENT_TYPE})
            resp.content_length = frame.size
            await resp.prepare(request)
            await resp.write(bytes(frame.encode())[: frame.size // 2])
            request.transport.close()
            return resp
        return await send_frame(request, frame)

    async def scenario():
        app = web.Application()
        app.router.add_get("/a", answer)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        url, pool = f"http://127.0.0.1:{port}/a", BufferPool(keep=1)
        try:
            async with aiohttp.ClientSession() as session:
                for rows in ([0, 1, 2], [2, 0], [1]):
                    async with session.get(url, params={"rows": ",".join(map(str, rows))}) as resp:
                        assert resp.content_length >= wire_http.DIRECT_MIN_BYTES
                        got = await read_frame(resp, pool=pool)
                    want = decode(bytes(wire.layout(tensors(rows), {"rows": rows}).encode()))
                    assert got.meta == {"rows": rows} and set(got.tensors) == set(want.tensors)
                    for name, t in want.tensors.items():
                        assert bits(got.tensors[name]) == bits(t), (rows, name)
                    assert (float(got.tensors["vals"].min()) < -1e29) == (1 in rows)
                    del got
                for _ in range(2):  # below DIRECT_MIN_BYTES: through aiohttp, the connection kept
                    async with session.get(url, params={"small": "1"}) as resp:
                        assert (await read_frame(resp)).tensors["x"].tolist() == list(range(10))
                with pytest.raises(
                    WireError, match=r"truncated body: \d+ bytes arrived; Content-Length declared"
                ):
                    async with session.get(url, params={"rows": "0,1,2", "cut": "1"}) as resp:
                        await read_frame(resp)
        finally:
            await runner.cleanup()

    asyncio.run(scenario())
    assert calls == {"send": 5, "recv": 4}  # every full answer through the duplicated sockets
    assert len({id(t) for t in connections[:3]}) == 3  # a direct read closes its connection
    assert connections[3] is connections[4]  # small answers keep theirs
