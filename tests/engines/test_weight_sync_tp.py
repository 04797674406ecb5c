"""Weight sync from a tensor-parallel actor (engines/megatron/tp_gather.py), torch backend over gloo.

Two real trainer processes form a TP = 2 gloo group; each holds only its megatron shards of a real tiny HF
Qwen3 (cut by the shard plan: the "fake shards" a TP = 2 GPTModel would hold), gathers the HF tensors one at
a time over the TP group, and TP rank 0 broadcasts them to a real HF rollout server subprocess
(`TorchBroadcastSender`, as at TP 1). Oracles: rank 0's gathered tensors equal the HF checkpoint bitwise, and
the server's answers (greedy tokens and their float32 log-probs) after the TP = 2 sync are
identical to its answers after a TP = 1 send of the same checkpoint from this process (and differ from the
served model's before either).
"""

from __future__ import annotations

import asyncio
import json
import textwrap
from pathlib import Path

import pytest
import torch
from helpers_auth import TOKEN
from helpers_ports import free_port
from helpers_ranks import run_ranks
from test_rollout_server import start_server, stop_server

from mopd_hpc.engines.megatron.convert import ConversionError, Qwen3Shape
from mopd_hpc.engines.megatron.shard_plan import ShardPlan
from mopd_hpc.engines.rollout.client import RolloutClient
from mopd_hpc.engines.rollout.protocol import SamplingParams
from mopd_hpc.engines.weight_sync.torch import TorchBroadcastSender

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [60, 2]]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)


def save_qwen3(path: Path, seed: int) -> Path:
    """A 2-layer Qwen3 with 4 query heads in 2 KV groups (TP 2: one group per rank), untied lm_head."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, tie_word_embeddings=False, initializer_range=0.2,
    )  # fmt: skip
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(str(path))
    return path


_TRAINER = textwrap.dedent(
    """
    import asyncio, json, sys
    import torch, torch.distributed as dist
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig
    from mopd_hpc.engines.megatron.convert import Qwen3Shape, pad_vocab_size
    from mopd_hpc.engines.megatron.shard_plan import ShardPlan
    from mopd_hpc.engines.rollout.client import RolloutClient
    from mopd_hpc.engines.weight_sync.torch import TorchBroadcastSender
    from mopd_hpc.engines.megatron.tp_gather import gathered_hf_weights

    rank, args = int(sys.argv[1]), json.loads(sys.argv[2])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args['tp_port']}", rank=rank, world_size=2)
    config = AutoConfig.from_pretrained(args["model"])
    shape = Qwen3Shape.from_hf_config(config, padded_vocab_size=pad_vocab_size(config.vocab_size, 2))
    plan = ShardPlan.create(shape, 2)
    hf = load_file(args["model"] + "/model.safetensors")
    local = plan.mcore_shard(plan.pieces(hf, rank))  # all this rank holds: its megatron shards
    del hf
    weights = gathered_hf_weights(plan, local, check_replicated=True)
    if rank == 0:
        sent = {}

        def recorded():
            for name, tensor in weights:
                sent[name] = tensor
                yield name, tensor

        async def main():
            async with RolloutClient(args["url"], token=args["token"]) as client:
                sender = TorchBroadcastSender("127.0.0.1", args["sync_port"], world_size=2, timeout_s=60)
                await sender.init_group(client)
                version = await sender.send(recorded(), client, weight_version="tp2",
                                            load_format=args["load_format"])
                await sender.destroy(client)
                return version

        version = asyncio.run(main())
        save_file(sent, args["out"])
        print(json.dumps({"version": version, "names": list(sent)}))
    else:
        print(json.dumps({"names": [name for name, _ in weights]}))
    dist.destroy_process_group()
    """
)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return save_qwen3(root / "served", seed=0), save_qwen3(root / "trainer", seed=1)


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    proc, url, _ = start_server(models[0], tmp_path_factory.mktemp("srv"))
    yield url
    assert stop_server(proc) == 0


async def answers(client: RolloutClient) -> list[tuple[list[int], list[float]]]:
    """(greedy tokens, their float32 log-probs) of each prompt."""
    return [(list(s.output_ids), list(s.behavior_logprobs)) for s in await client.generate(PROMPTS, GREEDY)]


def run_tp2_trainer(model: Path, url: str, out: Path, load_format: str | None) -> list[dict]:
    args = {
        "model": str(model), "url": url, "token": TOKEN, "tp_port": free_port(), "sync_port": free_port(),
        "out": str(out), "load_format": load_format,
    }  # fmt: skip
    outs = run_ranks(_TRAINER, lambda r: (str(r), json.dumps(args)))
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]


@pytest.mark.parametrize("load_format", ["flattened_bucket", None])
def test_tp2_shards_sync_like_the_tp1_send(server, models, tmp_path, load_format) -> None:
    from safetensors.torch import load_file

    served, trainer = models
    hf = load_file(str(trainer / "model.safetensors"))
    served_hf = load_file(str(served / "model.safetensors"))

    async def tp1_send(state: dict[str, torch.Tensor], version: str) -> None:
        async with RolloutClient(server, token=TOKEN) as client:
            sender = TorchBroadcastSender("127.0.0.1", free_port(), world_size=2, timeout_s=60)
            await sender.init_group(client)
            await sender.send(state, client, weight_version=version, load_format=load_format)
            await sender.destroy(client)

    async def look() -> tuple[list, str]:
        async with RolloutClient(server, token=TOKEN) as client:
            return await answers(client), (await client.model_info())["weight_version"]

    asyncio.run(tp1_send(served_hf, "served"))  # a known start, whatever the other parametrization left
    before, _ = asyncio.run(look())
    reports = run_tp2_trainer(trainer, server, tmp_path / "sent.safetensors", load_format)
    assert reports[0]["version"] == "tp2"
    assert reports[0]["names"] == reports[1]["names"] == list(ShardPlan.create(_shape(trainer), 2).tensors)
    sent = load_file(str(tmp_path / "sent.safetensors"))
    assert set(sent) == set(hf)
    for name in hf:  # the gathered tensors are the checkpoint's, bitwise
        assert sent[name].dtype == hf[name].dtype and torch.equal(sent[name], hf[name]), name
    after_tp2, version = asyncio.run(look())
    assert version == "tp2"
    asyncio.run(tp1_send(hf, "tp1"))
    after_tp1, version = asyncio.run(look())
    assert version == "tp1"
    assert after_tp2 == after_tp1  # exact float equality, every number
    assert before != after_tp2


def _shape(model: Path) -> Qwen3Shape:
    from transformers import AutoConfig

    from mopd_hpc.engines.megatron.convert import pad_vocab_size

    config = AutoConfig.from_pretrained(str(model))
    return Qwen3Shape.from_hf_config(config, padded_vocab_size=pad_vocab_size(config.vocab_size, 2))


def test_a_group_of_the_wrong_size_is_refused(models) -> None:
    """One process, no group needed for tp 1; a plan for TP 2 over a one-rank world names both sizes."""
    import torch.distributed as dist

    from mopd_hpc.engines.megatron.tp_gather import gathered_hf_weights

    shape = _shape(models[1])
    plan1, plan2 = ShardPlan.create(shape, 1), ShardPlan.create(shape, 2)
    from safetensors.torch import load_file

    hf = load_file(str(models[1] / "model.safetensors"))
    local = plan1.mcore_shard(plan1.pieces(hf, 0))
    got = dict(gathered_hf_weights(plan1, local))  # TP 1: no collective at all
    assert set(got) == set(hf) and all(torch.equal(got[k], hf[k]) for k in hf)
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(
            ConversionError, match="the TP group has 1 ranks; the shard plan is for tensor_parallel=2"
        ):
            next(gathered_hf_weights(plan2, plan2.mcore_shard(plan2.pieces(hf, 0))))
    finally:
        dist.destroy_process_group()
