"""The HF rollout server as a real subprocess on a real 127.0.0.1 port, serving a real micro Qwen3 model.

Oracles: the same checkpoint loaded in this process and run by a direct forward pass (log-probs at the
sampling temperature, greedy argmax), and an independent top-p/top-k renormalization written here.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import helpers_fork
import pytest
import torch
from helpers_auth import AUTH, TOKEN, write_token_file
from helpers_models import save_micro_qwen3
from helpers_ports import free_port

from mopd_hpc.engines.request_fields import RolloutRequestError
from mopd_hpc.engines.rollout.client import RolloutClient, RolloutServerError, RolloutUnavailableError
from mopd_hpc.engines.rollout.protocol import GenerateRequest, SamplingParams

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10, 11, 12]]
TOL = 1e-5
# The server on CUDA in bf16 (the static decoder, its decode step compiled into CUDA graphs) against the same
# bf16 checkpoint's direct forward on the same GPU: both round every activation and the logits to bf16, with
# other kernels (one-token GEMMs, SDPA over the cache, graph replays vs the full causal pass), so a logit may
# differ by a few bf16 ulps. The checkpoint is tests/engines/test_hf_decoder.py's (seed 0, initializer_range 0.2:
# |logit| <= 4.3, ulp 2**-5 = 0.031): the bound is 3 ulps of the largest logit, 0.1 nats, as there.
CUDA_BF16_TOL = 0.1
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def start_server(model: Path, tmp: Path, *extra: str) -> tuple[subprocess.Popen, str, Path]:
    """Start the server on a free port (token: helpers_auth.TOKEN); wait for its ready file. Returns (process,
    url, ready file)."""
    port, ready = free_port(), tmp / "ready.json"
    cmd = ["-m", "mopd_hpc.engines.rollout.hf_server", "--model", str(model)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--ready-file", str(ready), "--num-threads", "1"]
    cmd += ["--token-file", str(write_token_file(tmp / "token"))]
    cmd += list(extra)
    log = open(tmp / "server.log", "wb")  # noqa: SIM115 - the server writes it until teardown
    proc = helpers_fork.popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 90
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"server did not start: {(tmp / 'server.log').read_text()[-3000:]}")
        time.sleep(0.1)
    return proc, f"http://127.0.0.1:{port}", ready


def stop_server(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def http(url: str, path: str, body: object = None, raw: bytes | None = None) -> tuple[int, object]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(
        url + path, data=data, method="GET" if data is None else "POST", headers=AUTH
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            text = resp.read()
            return resp.status, json.loads(text) if text else None
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def oracle_logprobs(model, ids: list[int], temperature: float, device: str = "cpu") -> torch.Tensor:
    """[len(ids), V] float32 log-softmax(logits / T) of a direct forward on `device` (T = 1 when greedy), on
    the CPU."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids], device=device)).logits[0].float().cpu()
    return torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)


@pytest.fixture(scope="module")
def micro(tmp_path_factory) -> Path:
    return save_micro_qwen3(tmp_path_factory.mktemp("m0") / "model", seed=0)


@pytest.fixture(scope="module")
def oracle(micro):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(micro, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def server(micro, tmp_path_factory):
    proc, url, ready = start_server(micro, tmp_path_factory.mktemp("srv"))
    yield url, proc, ready
    assert stop_server(proc) == 0


def gen(url: str, prompt, **sampling) -> object:
    body = {"input_ids": prompt, "sampling_params": sampling, "return_logprob": True}
    status, out = http(url, "/generate", body)
    assert status == 200, out
    return out


def test_health_model_info_and_ready_file(server, micro):
    url, proc, ready = server
    assert http(url, "/health") == (200, None)
    status, info = http(url, "/model_info")
    assert status == 200
    assert info["model_path"] == str(micro) and info["weight_version"] == "default"
    assert info["vocab_size"] == 32 and info["architectures"] == ["Qwen3ForCausalLM"]
    record = json.loads(ready.read_text())
    assert record["pid"] == proc.pid and record["url"] == url


def test_generate_response_shape(server):
    url = server[0]
    body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
    status, out = http(url, "/generate", body | {"return_logprob": True, "logprob_start_len": 0})
    assert status == 200 and isinstance(out, dict)
    assert out["text"] == "" and len(out["output_ids"]) == 5
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["weight_version"]) == (4, 5, "default")
    assert [t[1] for t in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(t[2] is None and t[0] <= 0 for t in meta["output_token_logprobs"])
    assert meta["input_token_logprobs"][0] == [None, PROMPTS[0][0], None]
    assert [t[1] for t in meta["input_token_logprobs"]] == PROMPTS[0]
    status, out = http(url, "/generate", body)  # no logprobs asked: none returned
    assert "output_token_logprobs" not in out["meta_info"]
    top = body | {"return_logprob": True, "logprob_start_len": 2, "top_logprobs_num": 3}
    meta = http(url, "/generate", top)[1]["meta_info"]
    assert [t[1] for t in meta["input_token_logprobs"]] == PROMPTS[0][2:]
    assert len(meta["input_top_logprobs"]) == 2 and len(meta["output_top_logprobs"]) == 5
    for triples, (lp, tok, _) in zip(meta["output_top_logprobs"], meta["output_token_logprobs"], strict=True):
        values = [t[0] for t in triples]
        assert len(triples) == 3 and values == sorted(values, reverse=True) and lp <= values[0]
        assert tok not in [t[1] for t in triples] or lp == values[[t[1] for t in triples].index(tok)]


def test_sampling_seed_is_deterministic(server):
    url = server[0]
    a = gen(url, PROMPTS[1], max_new_tokens=16, temperature=1.0, sampling_seed=7, ignore_eos=True)
    b = gen(url, PROMPTS[1], max_new_tokens=16, temperature=1.0, sampling_seed=7, ignore_eos=True)
    c = gen(url, PROMPTS[1], max_new_tokens=16, temperature=1.0, sampling_seed=8, ignore_eos=True)
    assert a["output_ids"] == b["output_ids"]
    assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]
    assert a["output_ids"] != c["output_ids"]


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_behavior_logprobs_equal_direct_forward(server, oracle, temperature):
    url = server[0]
    prompt = PROMPTS[2]
    body = {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 0}
    body["sampling_params"] = {"max_new_tokens": 12, "temperature": temperature, "sampling_seed": 3}
    out = http(url, "/generate", body | {"sampling_params": body["sampling_params"] | {"ignore_eos": True}})[
        1
    ]
    ids = prompt + out["output_ids"]
    ref = oracle_logprobs(oracle, ids, temperature)
    n = len(prompt)
    expected = [float(ref[n - 1 + t, tok]) for t, tok in enumerate(out["output_ids"])]
    got = [t[0] for t in out["meta_info"]["output_token_logprobs"]]
    assert torch.allclose(torch.tensor(got), torch.tensor(expected), atol=TOL, rtol=0)
    got_in = [t[0] for t in out["meta_info"]["input_token_logprobs"][1:]]
    expected_in = [float(ref[i - 1, prompt[i]]) for i in range(1, n)]
    assert torch.allclose(torch.tensor(got_in), torch.tensor(expected_in), atol=TOL, rtol=0)
    if temperature == 0.0:
        assert out["output_ids"] == [int(ref[n - 1 + t].argmax()) for t in range(12)]


@pytest.fixture(scope="module")
def cuda_micro(tmp_path_factory) -> Path:
    return save_micro_qwen3(tmp_path_factory.mktemp("mc") / "model", seed=0, initializer_range=0.2)


@pytest.fixture(scope="module")
def cuda_server(cuda_micro, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("srv_cuda")
    proc, url, _ = start_server(cuda_micro, tmp, "--device", "cuda:0", "--dtype", "bfloat16")
    yield url, tmp / "server.log"
    assert stop_server(proc) == 0


@needs_cuda
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_behavior_logprobs_equal_direct_forward_cuda_bf16(cuda_server, cuda_micro, temperature):
    """μ of the tokens the CUDA server samples (bf16, compiled decode step) against a direct bf16 forward of the
    same checkpoint on the GPU: within CUDA_BF16_TOL for every prompt, sampled and prompt positions; greedy
    tokens are the oracle's argmax up to that tolerance (a near-tie may round either way in bf16)."""
    from transformers import AutoModelForCausalLM

    url, log = cuda_server
    ref_model = AutoModelForCausalLM.from_pretrained(cuda_micro, dtype=torch.bfloat16).to("cuda").eval()
    worst = 0.0
    for i, prompt in enumerate(PROMPTS):
        sampling = {
            "max_new_tokens": 12,
            "temperature": temperature,
            "sampling_seed": 3 + i,
            "ignore_eos": True,
        }
        body = {
            "input_ids": prompt,
            "return_logprob": True,
            "logprob_start_len": 0,
            "sampling_params": sampling,
        }
        status, out = http(url, "/generate", body)
        assert status == 200, out
        ids = prompt + out["output_ids"]
        ref = oracle_logprobs(ref_model, ids, temperature, "cuda")
        n = len(prompt)
        expected = torch.tensor([float(ref[n - 1 + t, tok]) for t, tok in enumerate(out["output_ids"])])
        got = torch.tensor([t[0] for t in out["meta_info"]["output_token_logprobs"]])
        got_in = torch.tensor([t[0] for t in out["meta_info"]["input_token_logprobs"][1:]])
        expected_in = torch.tensor([float(ref[j - 1, prompt[j]]) for j in range(1, n)])
        worst = max(worst, float((got - expected).abs().max()), float((got_in - expected_in).abs().max()))
        assert len(out["output_ids"]) == 12
        if temperature == 0.0:
            best = ref[n - 1 : n - 1 + 12].max(dim=-1).values
            assert bool((expected >= best - CUDA_BF16_TOL).all()), (expected, best)
    print(f"CUDA bf16 server vs direct forward, T={temperature}: largest |Δ log μ| {worst:.4f} nats")
    assert worst <= CUDA_BF16_TOL
    assert "decoding eagerly" not in log.read_text()  # the compiled decode step served every request


def test_top_p_top_k_logprobs_are_the_renormalized_distribution(server, oracle):
    url = server[0]
    top_p, top_k, temperature = 0.6, 6, 1.3
    out = gen(
        url, PROMPTS[0], max_new_tokens=10, temperature=temperature, top_p=top_p, top_k=top_k, sampling_seed=1
    )
    ids = PROMPTS[0] + out["output_ids"]
    full = oracle_logprobs(oracle, ids, temperature).exp().double()
    for t, (lp, tok, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
        p = full[len(PROMPTS[0]) - 1 + t]
        order = p.argsort(descending=True).tolist()
        kept, before = [], 0.0
        for rank, v in enumerate(order):  # SGLang's rule: keep while the mass ranked above <= top_p
            if rank >= top_k or (rank > 0 and before > top_p):
                break
            kept.append(v)
            before += float(p[v])
        assert tok in kept
        assert abs(lp - float(torch.log(p[tok] / p[kept].sum()))) < TOL


def test_max_new_tokens_and_stop_token_ids(server):
    url = server[0]
    free = gen(url, PROMPTS[2], max_new_tokens=10, temperature=0, ignore_eos=True)
    tok = free["output_ids"][-1]
    first = free["output_ids"].index(tok)
    stopped = gen(url, PROMPTS[2], max_new_tokens=10, temperature=0, stop_token_ids=[tok])
    assert stopped["output_ids"] == free["output_ids"][: first + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": tok}
    zero = gen(url, PROMPTS[2], max_new_tokens=0)
    assert zero["output_ids"] == [] and zero["meta_info"]["finish_reason"]["type"] == "length"
    assert len(gen(url, PROMPTS[2], max_new_tokens=3, ignore_eos=True)["output_ids"]) == 3


def test_batch_of_prompts_matches_single_requests(server):
    url = server[0]
    sampling = {"max_new_tokens": 8, "temperature": 0.9, "sampling_seed": 11, "n": 2, "ignore_eos": True}
    status, items = http(
        url, "/generate", {"input_ids": PROMPTS, "sampling_params": sampling, "return_logprob": True}
    )
    assert status == 200 and len(items) == 6
    for i, prompt in enumerate(PROMPTS):
        for j in range(2):
            item = items[2 * i + j]
            assert item["meta_info"]["prompt_tokens"] == len(prompt)
            single = gen(url, prompt, **(sampling | {"n": 1, "sampling_seed": 11 + j}))
            assert item["output_ids"] == single["output_ids"]
            a = torch.tensor([t[0] for t in item["meta_info"]["output_token_logprobs"]])
            b = torch.tensor([t[0] for t in single["meta_info"]["output_token_logprobs"]])
            assert torch.allclose(a, b, atol=TOL, rtol=0)


async def _wait_state(client: RolloutClient, key: str, value: int) -> None:
    for _ in range(600):
        if (await client.server_info())["internal_states"][0][key] == value:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{key} never reached {value}")


def test_pause_makes_generate_wait_until_continue(server):
    async def scenario():
        async with RolloutClient(server[0], token=TOKEN, retries=0) as client:
            expected = await client.generate([PROMPTS[0]], SamplingParams(max_new_tokens=4, temperature=0))
            await client.pause("in_place")
            task = asyncio.create_task(
                client.generate([PROMPTS[0]], SamplingParams(max_new_tokens=4, temperature=0))
            )
            await _wait_state(client, "num_waiting_reqs", 1)
            assert not task.done()
            assert (await client.server_info())["internal_states"][0]["paused"] is True
            await client.resume()
            samples = await task
            assert samples[0].output_ids == expected[0].output_ids and samples[0].finish_reason == "length"

    asyncio.run(scenario())


def test_pause_in_place_keeps_running_request(server):
    async def scenario():
        async with RolloutClient(server[0], token=TOKEN, retries=0) as client:
            long = SamplingParams(max_new_tokens=1500, ignore_eos=True, sampling_seed=5)
            reference = (await client.generate([PROMPTS[0]], long))[0]
            task = asyncio.create_task(client.generate([PROMPTS[0]], long))
            await _wait_state(client, "num_running_reqs", 1)
            await client.pause("in_place")
            state = (await client.server_info())["internal_states"][0]
            assert (state["paused"], state["pause_mode"], state["num_running_reqs"]) == (True, "in_place", 1)
            assert not task.done()
            await client.resume()
            sample = (await task)[0]
            assert sample.finish_reason == "length" and sample.output_ids == reference.output_ids
            assert sample.behavior_logprobs == reference.behavior_logprobs

    asyncio.run(scenario())


def test_pause_abort_ends_running_request(server):
    async def scenario():
        async with RolloutClient(server[0], token=TOKEN, retries=0) as client:
            long = SamplingParams(max_new_tokens=20000, ignore_eos=True, sampling_seed=0)
            task = asyncio.create_task(client.generate([PROMPTS[1]], long))
            await _wait_state(client, "num_running_reqs", 1)
            await client.pause("abort")
            sample = (await task)[0]
            assert sample.finish_reason == "abort"
            assert 0 <= len(sample.output_ids) < 20000 and len(sample.behavior_logprobs) == len(
                sample.output_ids
            )
            await client.resume()
            after = await client.generate([PROMPTS[1]], SamplingParams(max_new_tokens=2, ignore_eos=True))
            assert after[0].finish_reason == "length"

    asyncio.run(scenario())


def test_release_resume_round_trip_and_400(server):
    url = server[0]
    status, out = http(url, "/release_memory_occupation", {"tags": ["kv_cache", "weights"]})
    assert status == 200 and out["released_tags"] == ["kv_cache", "weights"]
    status, out = http(url, "/generate", {"input_ids": [1, 2]})
    assert status == 503 and "resume_memory_occupation" in out["message"]
    status, out = http(url, "/resume_memory_occupation", {"tags": ["cuda_graph"]})
    assert status == 400 and "['cuda_graph'] not released" in out["message"]
    status, out = http(url, "/resume_memory_occupation", {"tags": ["weights", "kv_cache"]})
    assert status == 200 and out["released_tags"] == []
    assert http(url, "/resume_memory_occupation", {"tags": ["weights"]})[0] == 400
    assert http(url, "/release_memory_occupation", {"tags": ["gpu"]})[0] == 400
    assert len(gen(url, [1, 2], max_new_tokens=2, ignore_eos=True)["output_ids"]) == 2
    status, out = http(url, "/release_memory_occupation", {})  # no tags = all three
    assert status == 200 and out["released_tags"] == ["cuda_graph", "kv_cache", "weights"]
    assert http(url, "/resume_memory_occupation", {})[1]["released_tags"] == []


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"{not json", "malformed JSON"),
        (b'{"input_ids": [1], "temperature": 1}', "unsupported field(s) ['temperature']"),
        (b'{"input_ids": [1], "sampling_params": {"min_p": 0.1}}', "sampling_params.min_p=0.1"),
        (b'{"input_ids": [1, 99]}', "token id 99 >= vocab_size 32"),
        (b'{"input_ids": [], "sampling_params": {}}', "input_ids=[]"),
        (b'{"input_ids": [1], "sampling_params": {"top_p": 0}}', "sampling_params.top_p=0"),
        (b"[1, 2]", "body=[1, 2]: expected a JSON object"),
    ],
)
def test_bad_requests_get_400_and_server_keeps_serving(server, raw, needle):
    url = server[0]
    status, out = http(url, "/generate", raw=raw)
    assert status == 400 and needle in out["message"] and out["success"] is False
    assert out["error"]["code"] == 400
    assert http(url, "/health")[0] == 200
    assert len(gen(url, [3], max_new_tokens=1)["output_ids"]) == 1


def test_client_errors_are_typed():
    async def scenario():
        async with RolloutClient(
            f"http://127.0.0.1:{free_port()}", retries=2, retry_backoff_s=0.01
        ) as client:
            assert await client.health() is False
            with pytest.raises(RolloutUnavailableError, match="after 3 attempts"):
                await client.model_info()

    asyncio.run(scenario())


def test_client_raises_server_message(server):
    async def scenario():
        async with RolloutClient(server[0], token=TOKEN) as client:
            with pytest.raises(RolloutServerError, match="not released") as info:
                await client.resume_memory(["cuda_graph"])
            assert info.value.status == 400

    asyncio.run(scenario())


def test_server_args_read_named_port_from_env(tmp_path):
    from mopd_hpc.engines.rollout.hf_server import ServerArgs

    env = {"MOPD_PORT_HTTP": "31234", "MOPD_ROLLOUT_MODEL": "/m", "MOPD_ROLLOUT_READY_FILE": "/r.json"}
    args = ServerArgs.from_argv([], env)
    assert (args.port, args.model_path, args.ready_file, args.device) == (31234, "/m", "/r.json", "cpu")
    assert ServerArgs.from_argv(["--port", "7", "--model", "/x", "--device", "cuda:1"], env).port == 7
    with pytest.raises(SystemExit) as exit_info:
        ServerArgs.from_argv(["--model", "/x"], {})
    assert exit_info.value.code == 2


def test_protocol_validation():
    with pytest.raises(RolloutRequestError, match=r"sampling_params.top_k=0: expected -1 \(off\)"):
        SamplingParams.from_json({"top_k": 0})
    with pytest.raises(RolloutRequestError, match="exactly one of 'input_ids' and 'text'"):
        GenerateRequest.from_json({"sampling_params": {}})
    req = GenerateRequest.from_json(
        {"input_ids": [[1], [2, 3]], "sampling_params": [{"n": 2}, {"temperature": 0}]}
    )
    assert (
        req.is_batch and req.prompts == ((1,), (2, 3)) and req.sampling[0].n == 2 and req.sampling[1].greedy
    )
    assert SamplingParams.from_json(SamplingParams(top_k=3, sampling_seed=5).to_json()) == SamplingParams(
        top_k=3, sampling_seed=5
    )
