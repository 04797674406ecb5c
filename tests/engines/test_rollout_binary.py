"""Binary transport of /generate (`engines/rollout/generate_wire.py`): the real HF rollout server as a
subprocess on a real port, a micro Qwen3. Oracles: the server's own JSON answer to the same request, and
the same engine run in this process (bit for bit)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch
from aiohttp import web
from helpers_auth import AUTH, TOKEN
from helpers_models import save_micro_qwen3
from helpers_ports import free_port
from test_rollout_server import PROMPTS, start_server, stop_server

from mopd_hpc.engines.frames.codec import CONTENT_TYPE, WireError, decode
from mopd_hpc.engines.frames.over_http import ACCEPT_HEADERS, read_frame
from mopd_hpc.engines.request_fields import RolloutRequestError
from mopd_hpc.engines.rollout.client import RolloutClient
from mopd_hpc.engines.rollout.generate_wire import GeneratedBatch
from mopd_hpc.engines.rollout.protocol import SamplingParams

SAMPLING = SamplingParams(max_new_tokens=7, temperature=0.9, sampling_seed=5, n=2, ignore_eos=True)
RIDS = [f"r{i}" for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_micro_qwen3(tmp_path_factory.mktemp("m") / "model", seed=0)


@pytest.fixture(scope="module")
def url(model, tmp_path_factory):
    proc, url, _ = start_server(model, tmp_path_factory.mktemp("srv"))
    yield url
    assert stop_server(proc) == 0


def without_latency(answer):
    """The answer with meta_info.e2e_latency dropped (the only field that differs between two requests)."""
    items = answer if isinstance(answer, list) else [answer]
    out = [
        dict(i) | {"meta_info": {k: v for k, v in i["meta_info"].items() if k != "e2e_latency"}}
        for i in items
    ]
    return out if isinstance(answer, list) else out[0]


async def post(url: str, body: dict, binary: bool):
    async with aiohttp.ClientSession(headers=AUTH) as session:
        headers = ACCEPT_HEADERS if binary else None
        async with session.post(url + "/generate", json=body, headers=headers) as resp:
            assert resp.status == 200
            if binary:
                assert resp.content_type == CONTENT_TYPE
                return await read_frame(resp)
            return await resp.json()


@pytest.mark.parametrize(
    "extra",
    [
        {"return_logprob": True},
        {"return_logprob": False},
        {"return_logprob": True, "logprob_start_len": 1, "top_logprobs_num": 3},
    ],
)
def test_frame_rebuilds_the_json_answer_exactly(url, extra):
    body = {"input_ids": PROMPTS, "sampling_params": SAMPLING.to_json(), "rid": RIDS} | extra
    as_json = asyncio.run(post(url, body, binary=False))
    frame = asyncio.run(post(url, body, binary=True))
    batch = GeneratedBatch.from_frame(frame)
    assert batch.output_ids.dtype == torch.int32 and batch.output_lengths.tolist() == [7] * 6
    if extra["return_logprob"]:
        assert batch.output_logprobs is not None and batch.output_logprobs.dtype == torch.float32
    else:
        assert batch.output_logprobs is None
    assert without_latency(batch.to_sglang()) == without_latency(as_json)  # floats compared exactly
    again = GeneratedBatch.from_sglang(as_json)  # JSON → tensors → frame → the same JSON
    assert without_latency(GeneratedBatch.from_frame(decode(again.encode())).to_sglang()) == without_latency(
        as_json
    )
    single = asyncio.run(
        post(url, body | {"input_ids": PROMPTS[0], "rid": "one"} | {"sampling_params": {"n": 1}}, True)
    )
    assert not GeneratedBatch.from_frame(single).is_batch


def test_client_generate_binary_equals_json_and_the_engine_bitwise(url, model):
    from mopd_hpc.engines.rollout.hf_engine import HFRolloutEngine
    from mopd_hpc.engines.rollout.rows import RowRequest

    async def both():
        async with (
            RolloutClient(url, binary=False, token=TOKEN) as js,
            RolloutClient(url, token=TOKEN) as binary,
        ):
            return (
                await js.generate(PROMPTS, SAMPLING, rids=RIDS),
                await binary.generate(PROMPTS, SAMPLING, rids=RIDS),
                await binary.generate_batch(
                    {"input_ids": PROMPTS, "sampling_params": SAMPLING.to_json(), "return_logprob": True}
                ),
            )

    from_json, from_binary, batch = asyncio.run(both())
    assert from_binary == from_json and len(from_binary) == 6
    assert [s.rid for s in from_binary] == ["r0-0", "r0-1", "r1-0", "r1-1", "r2-0", "r2-1"]
    mu_json = torch.tensor([v for s in from_json for v in s.behavior_logprobs], dtype=torch.float32)
    assert torch.equal(mu_json.view(torch.int32), batch.output_logprobs.view(torch.int32))

    class Open:
        def between_steps(self) -> bool:
            return True

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the server's --num-threads
    try:
        engine = HFRolloutEngine.load(str(model))
        rows = [RowRequest(tuple(p), SAMPLING, 5 + j, True) for p in PROMPTS for j in range(2)]
        results = engine.generate(rows, Open())
    finally:
        torch.set_num_threads(threads)
    assert batch.output_ids.tolist() == [t for r in results for t in r.output_ids]
    mu = torch.tensor([v for r in results for v in r.output_logprobs], dtype=torch.float32)
    assert torch.equal(mu.view(torch.int32), batch.output_logprobs.view(torch.int32))


def test_binary_client_reads_a_json_only_server_and_refuses_bad_frames():
    """A server that ignores Accept (as SGLang's own does) answers JSON: the client takes it; a server
    that answers a broken frame is refused with the frame's fault."""
    answer = [
        {"text": "", "output_ids": [3, 4], "meta_info": {"id": "a", "finish_reason": {"type": "length"},
                                                          "output_token_logprobs": [[-0.5, 3, None], [-1.25, 4, None]]}},
    ]  # fmt: skip

    async def scenario():
        async def json_only(request: web.Request) -> web.Response:
            return web.json_response(answer)

        async def broken(request: web.Request) -> web.Response:
            return web.Response(body=b"\x10\0\0\0\0\0\0\0{}", content_type=CONTENT_TYPE)

        app = web.Application()
        app.router.add_post("/generate", json_only)
        app.router.add_post("/broken/generate", broken)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with RolloutClient(f"http://127.0.0.1:{port}") as client:
                samples = await client.generate([[1, 2]], SamplingParams(max_new_tokens=2))
            async with RolloutClient(f"http://127.0.0.1:{port}/broken", retries=0) as client:
                with pytest.raises(Exception, match="unreadable frame: truncated frame") as err:
                    await client.generate([[1, 2]], SamplingParams(max_new_tokens=2))
            return samples, err.value
        finally:
            await runner.cleanup()

    samples, err = asyncio.run(scenario())
    assert samples[0].output_ids == (3, 4) and samples[0].behavior_logprobs == (-0.5, -1.25)
    assert type(err).__name__ == "RolloutServerError"
    with pytest.raises(RolloutRequestError, match=r"answer holds 1 items; expected 2 prompts × n=1"):
        GeneratedBatch.from_sglang(answer).samples([[1], [2]], 1)
    with pytest.raises(RolloutRequestError, match="output_token_logprobs ids != output_ids"):
        GeneratedBatch.from_sglang([answer[0] | {"output_ids": [3, 5]}])
    frame = decode(GeneratedBatch.from_sglang(answer).encode())
    with pytest.raises(WireError, match="1 items, output_lengths 1 summing to 2, output_ids 1"):
        GeneratedBatch.from_frame(
            type(frame)(
                dict(frame.tensors) | {"output_ids": torch.tensor([3], dtype=torch.int32)}, frame.meta
            )
        )
