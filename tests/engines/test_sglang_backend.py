"""The sglang rollout backend without sglang: launch-args mapping from named ports, the request/response mapping
against SGLang 0.5.23's documented shapes, environment and readiness rules, and the HTTP surface over a
stand-in with sglang.Engine's Python API (a real aiohttp server on 127.0.0.1). Tests that need sglang itself are
marked `sglang` and skip where it is absent."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from aiohttp import test_utils
from helpers_auth import AUTH, TOKEN

from mopd_hpc.engines.rollout.protocol import GenerateRequest
from mopd_hpc.engines.rollout.sglang_backend import (
    AWEX_READY_PATH,
    HEALTH_PATH,
    SGLangBackendError,
    SGLangLaunch,
    check_environment,
    check_item,
    generate_kwargs,
    ports_from_env,
    readiness_path,
)
from mopd_hpc.engines.rollout.sglang_server import SGLangRolloutServer, sglang_app

PORTS = {"http": 31000, "nccl": 31001, "dist_init": 31002, "master": 31003}


def test_named_ports_map_to_server_args() -> None:
    launch = SGLangLaunch.from_ports("/m", PORTS, host="10.1.2.3", tp_size=2, base_gpu_id=4)
    kw = launch.engine_kwargs()
    assert (kw["port"], kw["nccl_port"], kw["dist_init_addr"]) == (31000, 31001, "10.1.2.3:31002")
    assert kw["enable_memory_saver"] is True and kw["tp_size"] == 2 and kw["base_gpu_id"] == 4
    assert kw["dp_size"] == 1 and kw["node_rank"] == 0
    # what SGLang 0.5.17 started with on the H100 probe; decode graphs at SGLang's default size unless given
    assert kw["skip_tokenizer_init"] and kw["disable_prefill_cuda_graph"]
    assert (kw["attention_backend"], kw["sampling_backend"]) == ("triton", "pytorch")
    assert "cuda_graph_max_bs_decode" not in kw
    argv = launch.to_argv()
    assert argv[argv.index("--port") + 1] == "31000"
    assert argv[argv.index("--nccl-port") + 1] == "31001"
    assert argv[argv.index("--dist-init-addr") + 1] == "10.1.2.3:31002"
    assert "--enable-memory-saver" in argv
    env = {"MOPD_PORT_HTTP": "31000", "MOPD_PORT_NCCL": "31001", "MOPD_PORT_DIST_INIT": "31002"}
    assert ports_from_env(env) == {"http": 31000, "nccl": 31001, "dist_init": 31002}


def test_launch_errors_name_the_port() -> None:
    with pytest.raises(SGLangBackendError, match=r"named port\(s\) \['dist_init'\] missing"):
        SGLangLaunch.from_ports("/m", {"http": 1, "nccl": 2})
    with pytest.raises(SGLangBackendError, match="share a number"):
        SGLangLaunch.from_ports("/m", {"http": 5, "nccl": 5, "dist_init": 6})
    with pytest.raises(SGLangBackendError, match="port nccl=70000"):
        SGLangLaunch.from_ports("/m", {"http": 5, "nccl": 70000, "dist_init": 6})
    with pytest.raises(SGLangBackendError, match="enable_memory_saver=False"):
        SGLangLaunch.from_ports("/m", PORTS, enable_memory_saver=False)
    with pytest.raises(SGLangBackendError, match="MOPD_PORT_NCCL=None"):
        ports_from_env({"MOPD_PORT_HTTP": "1"})


def test_environment_and_readiness_rules() -> None:
    check_environment(
        {"SGLANG_RETURN_ORIGINAL_LOGPROB": "0", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}
    )
    with pytest.raises(SGLangBackendError, match="temperature-1 log-probs"):
        check_environment({"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"})
    with pytest.raises(SGLangBackendError, match="expandable_segments"):
        check_environment({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    check_environment({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, memory_saver=False)
    assert readiness_path(awex=False) == HEALTH_PATH == "/health"
    assert readiness_path(awex=True) == AWEX_READY_PATH == "/model_info"


def test_generate_request_mapping() -> None:
    req = GenerateRequest.from_json(
        {
            "input_ids": [[1, 2, 3], [4, 5]],
            "sampling_params": {"max_new_tokens": 8, "temperature": 0.7, "n": 2, "sampling_seed": 10},
            "return_logprob": True,
            "rid": ["a", "b"],
        }
    )
    kw = generate_kwargs(req)
    assert kw["input_ids"] == [[1, 2, 3], [1, 2, 3], [4, 5], [4, 5]]  # prompt-major, n copies each
    assert [p["sampling_seed"] for p in kw["sampling_params"]] == [10, 11, 10, 11]
    assert all(p["n"] == 1 and p["temperature"] == 0.7 for p in kw["sampling_params"])
    assert kw["rid"] == ["a-0", "a-1", "b-0", "b-1"]
    assert kw["return_logprob"] is True and kw["logprob_start_len"] == -1
    with pytest.raises(ValueError, match="takes input_ids"):
        generate_kwargs(GenerateRequest.from_json({"text": "hi"}))


def sglang_item(
    prompt: list[int], out: list[int], logprobs: list[float], start0: bool = False
) -> dict[str, Any]:
    """A response item exactly as SGLang 0.5.23 documents it (io_struct.py / tokenizer_manager.py)."""
    meta: dict[str, Any] = {
        "id": "r1",
        "finish_reason": {"type": "length", "length": len(out)},
        "prompt_tokens": len(prompt),
        "completion_tokens": len(out),
        "cached_tokens": 0,
        "weight_version": "default",
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, out, strict=True)],
    }
    if start0:
        meta["input_token_logprobs"] = [[None, prompt[0], None]] + [[-1.5, t, None] for t in prompt[1:]]
    return {"text": "", "output_ids": out, "meta_info": meta}


def test_response_mapping_of_documented_shapes() -> None:
    item = sglang_item([1, 2, 3], [7, 8], [-0.25, -1.0], start0=True)
    sample = check_item(item, [1, 2, 3], return_logprob=True, logprob_start_len=0)
    assert sample.output_ids == (7, 8) and sample.behavior_logprobs == (-0.25, -1.0)
    assert sample.finish_reason == "length" and sample.prompt_ids == (1, 2, 3) and sample.rid == "r1"
    item["meta_info"]["input_token_logprobs"][0] = None  # the bare None form is accepted too
    check_item(item, [1, 2, 3], return_logprob=True, logprob_start_len=0)
    bad = sglang_item([1, 2, 3], [7, 8], [-0.25, -1.0], start0=True)
    bad["meta_info"]["input_token_logprobs"][0] = [-0.5, 1, None]
    with pytest.raises(SGLangBackendError, match=r"input_token_logprobs\[0\].*expected None"):
        check_item(bad, [1, 2, 3], return_logprob=True, logprob_start_len=0)
    short = sglang_item([1], [7, 8], [-0.25, -1.0])
    short["meta_info"]["output_token_logprobs"].pop()
    with pytest.raises(SGLangBackendError, match="has 1 entries; expected one per output id \\(2\\)"):
        check_item(short, [1], return_logprob=True)
    swapped = sglang_item([1], [7, 8], [-0.25, -1.0])
    swapped["meta_info"]["output_token_logprobs"][1] = [8, -1.0, None]  # (token, logprob): wrong order
    with pytest.raises(SGLangBackendError):
        check_item(swapped, [1], return_logprob=True)
    plain = check_item(sglang_item([1], [7], [-0.1]), [1], return_logprob=False)
    assert plain.behavior_logprobs == ()


class FakeSGLangEngine:
    """Stands in for sglang.Engine's Python API; records calls; answers in SGLang 0.5.17's shapes."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.released: set[str] = set()

    def generate(self, **kw: Any) -> Any:
        self.calls.append(("generate", kw))
        ids = kw["input_ids"]
        rows = ids if ids and isinstance(ids[0], list) else [ids]
        items = [sglang_item(r, [5, 6], [-0.5, -0.75]) for r in rows]
        return items if isinstance(ids[0], list) else items[0]

    def release_memory_occupation(self, tags: list[str]) -> None:
        assert not self.released & set(tags), "SGLang raises on a tag released twice"
        self.calls.append(("release", list(tags)))
        self.released |= set(tags)

    def resume_memory_occupation(self, tags: list[str]) -> None:
        assert set(tags) <= self.released, "SGLang raises on resuming a tag that was not released"
        self.calls.append(("resume", list(tags)))
        self.released -= set(tags)

    def flush_cache(self) -> None:
        self.calls.append(("flush", None))


def test_http_surface_over_the_engine_api() -> None:
    async def scenario() -> None:
        engine = FakeSGLangEngine()
        server = SGLangRolloutServer(SGLangLaunch.from_ports("/m", PORTS), engine)
        async with (
            test_utils.TestServer(sglang_app(server, TOKEN), host="127.0.0.1") as ts,
            aiohttp.ClientSession(headers=AUTH) as http,
        ):
            base = f"http://127.0.0.1:{ts.port}"
            async with http.get(base + "/health") as r:
                assert r.status == 200
            body = {
                "input_ids": [[1, 2], [3]],
                "sampling_params": {"max_new_tokens": 2},
                "return_logprob": True,
            }
            async with http.post(base + "/generate", json=body) as r:
                assert r.status == 200
                items = await r.json()
            assert [i["output_ids"] for i in items] == [[5, 6], [5, 6]]
            assert items[0]["meta_info"]["output_token_logprobs"][0] == [-0.5, 5, None]
            for _ in range(2):  # idempotent: the second release touches nothing
                async with http.post(
                    base + "/release_memory_occupation", json={"tags": ["weights", "kv_cache"]}
                ) as r:
                    assert r.status == 200
            async with http.get(base + "/health") as r:
                assert r.status == 503  # the generating probe fails while weights are released
            async with http.get(base + "/model_info") as r:
                assert (
                    r.status == 200 and (await r.json())["model_path"] == "/m"
                )  # AWEX readiness still answers
            async with http.post(base + "/generate", json=body) as r:
                assert r.status == 503
            async with http.post(base + "/resume_memory_occupation", json={}) as r:
                assert r.status == 200 and (await r.json())["released"] == []
            async with http.post(base + "/generate", json={"input_ids": [1], "stream": True}) as r:
                assert r.status == 400
        kinds = [c[0] for c in engine.calls]
        assert kinds == ["generate", "generate", "release", "resume"]
        assert sorted(engine.calls[2][1]) == ["kv_cache", "weights"]
        assert sorted(engine.calls[3][1]) == ["kv_cache", "weights"]

    asyncio.run(scenario())


@pytest.mark.sglang
def test_sglang_server_args_accept_the_mapping() -> None:
    server_args = pytest.importorskip("sglang.srt.server_args", reason="sglang is not installed")
    fields = set(server_args.ServerArgs.__dataclass_fields__)
    assert set(SGLangLaunch.from_ports("/m", PORTS).engine_kwargs()) <= fields
