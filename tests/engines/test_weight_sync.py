"""Weight sync over gloo: this test process is the trainer (rank 0) with a micro model of another seed;
a real rollout server subprocess (rank 1) receives its weights; a dense Qwen3 and a Qwen3-MoE (its fused
experts and routers). Oracle: the trainer model's own greedy
decode and log-probs; the server's outputs before the sync differ from them, after it they match.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from helpers_auth import TOKEN
from helpers_models import save_micro_moe, save_micro_qwen3
from helpers_ports import free_port
from test_rollout_server import TOL, start_server, stop_server

from mopd_hpc.engines.rollout.client import RolloutClient, RolloutServerError
from mopd_hpc.engines.rollout.protocol import SamplingParams
from mopd_hpc.engines.weight_sync.torch import TorchBroadcastSender, WeightSyncConfigError, WeightSyncError

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8]]
GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)


def own_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy decode by full forward passes (no cache): tokens and their log-softmax log-probs."""
    ids, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)
            tok = int(logp.argmax())
            ids.append(tok)
            lps.append(float(logp[tok]))
    return ids[len(prompt) :], lps


def matches(samples, model) -> bool:
    """True when every sample's greedy tokens and log-probs (within TOL) are the model's own."""
    for prompt, sample in zip(PROMPTS, samples, strict=True):
        ids, lps = own_greedy(model, prompt, GREEDY.max_new_tokens)
        if list(sample.output_ids) != ids:
            return False
        if not torch.allclose(torch.tensor(sample.behavior_logprobs), torch.tensor(lps), atol=TOL, rtol=0):
            return False
    return True


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def models(tmp_path_factory, request):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("models")
    save = save_micro_qwen3 if request.param == "qwen3" else save_micro_moe
    served = save(root / "served", seed=0)
    trainer_dir = save(root / "trainer", seed=1)
    load = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()  # noqa: E731
    return served, trainer_dir, load(served), load(trainer_dir)


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    proc, url, _ = start_server(models[0], tmp_path_factory.mktemp("srv"))
    yield url
    assert stop_server(proc) == 0


def test_trainer_weights_arrive_over_gloo(server, models):
    _, trainer_dir, served_model, trainer_model = models

    async def scenario():
        async with RolloutClient(server, token=TOKEN) as client:
            before = await client.generate(PROMPTS, GREEDY)
            assert matches(before, served_model) and not matches(before, trainer_model)

            sender = TorchBroadcastSender(
                "127.0.0.1", free_port(), world_size=2, backend="gloo", timeout_s=60
            )
            await sender.init_group(client)
            assert (await client.server_info())["internal_states"][0]["weight_update_groups"] == [
                "weight_update_group"
            ]

            version = await sender.send(trainer_model.state_dict(), client)  # flattened buckets
            assert version == "1" and (await client.model_info())["weight_version"] == "1"
            after = await client.generate(PROMPTS, GREEDY)
            assert matches(after, trainer_model) and {s.weight_version for s in after} == {"1"}

            # one broadcast per tensor, bf16 on the wire: back to the served model's weights
            bf16 = {k: v.to(torch.bfloat16) for k, v in served_model.named_parameters()}
            assert await sender.send(bf16, client, weight_version="step-2", load_format=None) == "step-2"
            info = await client.model_info()
            assert info["weight_version"] == "step-2" and info["dtype"] == "float32"
            state = {k: v.to(torch.bfloat16).float() for k, v in served_model.state_dict().items()}
            rounded = type(served_model)(served_model.config).eval()
            rounded.load_state_dict(state)
            assert matches(await client.generate(PROMPTS, GREEDY), rounded)

            # a tensor the model does not have: refused after the broadcast, group still usable
            with pytest.raises(WeightSyncError, match="not a parameter of the model"):
                await sender.send({"model.nope.weight": torch.zeros(3)}, client)
            assert (await client.model_info())["weight_version"] == "step-2"
            assert await sender.send(trainer_model.state_dict(), client) == "3"
            assert matches(await client.generate(PROMPTS, GREEDY), trainer_model)

            await sender.destroy(client)
            assert (await client.server_info())["internal_states"][0]["weight_update_groups"] == []
            with pytest.raises(RolloutServerError, match="no such weight-update group") as err:
                await client.destroy_weights_update_group()
            assert err.value.status == 400

    asyncio.run(scenario())


def test_update_weights_from_disk(server, models):
    served_dir, trainer_dir, served_model, trainer_model = models

    async def scenario():
        async with RolloutClient(server, token=TOKEN) as client:
            await client.update_weights_from_disk(str(trainer_dir), weight_version="disk-1")
            info = await client.model_info()
            assert info["weight_version"] == "disk-1" and info["model_path"] == str(trainer_dir)
            assert matches(await client.generate(PROMPTS, GREEDY), trainer_model)
            with pytest.raises(RolloutServerError, match="not a directory"):
                await client.update_weights_from_disk(str(trainer_dir / "missing"))
            await client.update_weights_from_disk(str(served_dir))
            assert matches(await client.generate(PROMPTS, GREEDY), served_model)

    asyncio.run(scenario())


def test_init_group_errors(server):
    async def scenario():
        async with RolloutClient(server, token=TOKEN) as client:
            with pytest.raises(WeightSyncConfigError, match="world_size=3 but 1 servers"):
                await TorchBroadcastSender("127.0.0.1", free_port(), world_size=3).init_group(client)
            body = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}
            with pytest.raises(RolloutServerError, match="backend='nccl': the model is on cpu"):
                await client.request("POST", "/init_weights_update_group", body)
            with pytest.raises(
                RolloutServerError, match=r"rank_offset=2: expected a rank in \[1, world_size=2\)"
            ):
                await client.request("POST", "/init_weights_update_group", body | {"rank_offset": 2})

    with pytest.raises(WeightSyncConfigError, match="backend='mpi'"):
        TorchBroadcastSender("127.0.0.1", 1234, world_size=2, backend="mpi")

    asyncio.run(scenario())


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (trainer on 0, server on 1)")
def test_nccl_sync_and_real_weight_offload_on_gpu(models, tmp_path):
    _, _, served_model, trainer_model = models
    proc, url, _ = start_server(models[0], tmp_path, "--device", "cuda:1", "--weight-sync-timeout-s", "60")
    gpu_trainer = type(trainer_model)(trainer_model.config).to("cuda:0").eval()
    gpu_trainer.load_state_dict(trainer_model.state_dict())

    async def scenario():
        async with RolloutClient(url, token=TOKEN) as client:
            sender = TorchBroadcastSender("127.0.0.1", free_port(), 2, "nccl", timeout_s=60, device="cuda:0")
            await sender.init_group(client)
            assert await sender.send(gpu_trainer.state_dict(), client) == "1"
            samples = await client.generate(PROMPTS, GREEDY)
            for prompt, sample in zip(PROMPTS, samples, strict=True):
                ids, lps = own_greedy(trainer_model, prompt, GREEDY.max_new_tokens)
                assert list(sample.output_ids) == ids
                assert torch.allclose(
                    torch.tensor(sample.behavior_logprobs), torch.tensor(lps), atol=1e-4, rtol=0
                )
            held = (await client.server_info())["internal_states"][0]["device_memory_allocated_bytes"]
            await client.release(["weights", "kv_cache"])
            freed = (await client.server_info())["internal_states"][0]["device_memory_allocated_bytes"]
            assert held > 0 and freed < held
            with pytest.raises(RolloutServerError) as err:
                await client.generate(PROMPTS, GREEDY)
            assert err.value.status == 503
            await client.resume_memory(["weights", "kv_cache"])
            assert (await client.server_info())["internal_states"][0]["device_memory_allocated_bytes"] == held
            again = await client.generate(PROMPTS, GREEDY)
            assert [s.output_ids for s in again] == [s.output_ids for s in samples]
            await sender.destroy(client)

    try:
        asyncio.run(scenario())
    finally:
        assert stop_server(proc) == 0
