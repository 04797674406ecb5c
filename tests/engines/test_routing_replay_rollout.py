"""Rollout routing replay, the rollout's half: the real HF rollout server (a subprocess on a real port) serving a
micro Qwen3-MoE records each response token's routed experts per MoE layer, over the binary frame and JSON
alike; they travel in the actor group's control record, and the trainer's forward replaying them gives the
rollout's μ. Oracles: a full forward of prompt + response by transformers (`output_router_logits`), each
layer's top k at the position that predicts each token; the rollout's own log-probs μ."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from helpers_auth import TOKEN
from helpers_models import MOE_TOP_K as TOP_K
from helpers_models import save_micro_moe
from test_rollout_server import start_server, stop_server
from test_torch_engine_moe import make_engine
from transformers import Qwen3MoeForCausalLM

from mopd_hpc.engines.batch import TokenBatch, TrainBatch
from mopd_hpc.engines.rollout.client import RolloutClient
from mopd_hpc.engines.rollout.protocol import SamplingParams
from mopd_hpc.mopd.targets import aggregate_teacher_targets
from mopd_hpc.trainer.rollout_phase import padded_routes
from mopd_hpc.trainer.step_record import ControlRecord

PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10, 11, 12]]
SAMPLING = SamplingParams(max_new_tokens=6, temperature=1.0, sampling_seed=3, n=2, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    return save_micro_moe(tmp_path_factory.mktemp("moe") / "model")


@pytest.fixture(scope="module")
def url(moe, tmp_path_factory):
    proc, url, _ = start_server(moe, tmp_path_factory.mktemp("srv"))
    yield url
    assert stop_server(proc) == 0


async def _generate(url: str, binary: bool):
    async with RolloutClient(url, binary=binary, token=TOKEN) as client:
        return await client.generate(PROMPTS, SAMPLING, return_routed_experts=True)


def test_the_rollout_records_each_tokens_routed_experts_and_the_trainer_replays_them(
    moe: Path, url: str
) -> None:
    samples = asyncio.run(_generate(url, binary=True))
    as_json = asyncio.run(_generate(url, binary=False))
    assert len(samples) == 6
    for s, j in zip(samples, as_json, strict=True):
        assert s.routed_experts.dtype == torch.int16 and s.routed_experts.shape == (6, 2, TOP_K)
        assert torch.equal(s.routed_experts, j.routed_experts) and s.output_ids == j.output_ids

    tokens = TokenBatch.from_samples([s.prompt_ids for s in samples], [s.output_ids for s in samples], 0)
    routed = padded_routes(samples, tokens.response_width)
    # the oracle: transformers' own routing of prompt + response, at the position predicting each token
    ref = Qwen3MoeForCausalLM.from_pretrained(str(moe), dtype=torch.float32)
    with torch.no_grad():
        out = ref(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, output_router_logits=True)
    b, n = tokens.input_ids.shape
    own = torch.stack([r.topk(TOP_K, dim=-1).indices for r in out.router_logits], dim=1).reshape(
        b, n, 2, TOP_K
    )
    mask = tokens.response_mask
    at = torch.arange(b)[:, None].expand_as(mask)
    expected = own[at[mask], tokens.logit_positions[mask]]
    assert torch.equal(routed[mask].long().sort(-1).values, expected.sort(-1).values)
    assert bool((routed[~mask] == -1).all())

    # the control record's frame carries them to every rank, padded as the shard's tokens
    mu = tokens.pad_response_values([s.behavior_logprobs for s in samples])
    rows = [s.prompt_ids + s.output_ids for s in samples]
    starts = [len(s.prompt_ids) for s in samples]
    record = ControlRecord.from_rows(1, rows, starts, ["r"] * 6, mu, None, 0, routed)
    back = ControlRecord.from_bytes(record.to_bytes())
    shard = back.tokens(2, 5)
    assert torch.equal(back.routed_experts(shard, 2, 5), routed[2:5, : shard.response_width])

    # the trainer's forward with the recorded experts gives the rollout's μ (same weights, float32)
    engine = make_engine(moe, router_aux_loss_coefficient=0.0)
    targets = aggregate_teacher_targets({"t": mu}, [{"t": 1.0}] * len(samples))
    batch = TrainBatch.create(tokens, mu, targets=targets, routed_experts=routed)
    _, logprobs, _ = engine.compute_loss(batch)
    engine.routing.end()
    torch.testing.assert_close(torch.where(mask, logprobs.detach(), 0.0), mu, rtol=0, atol=1e-4)
