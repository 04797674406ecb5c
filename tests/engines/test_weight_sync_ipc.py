"""Colocated weight sync by shared buffers (weight_sync.backend: ipc): this test process is the actor (an
`IpcSync` over a micro Qwen3 of another seed), a real rollout server subprocess maps the buffer. Oracle: the
sender's own tensors; after each of three syncs every parameter of the server (read back through
/get_weights_by_name) is bitwise the sender's. On CPU the buffer is a /dev/shm file; with a CUDA device the
same test runs through CUDA IPC (the coordinator's GPU run).
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch
from helpers_auth import TOKEN
from helpers_models import save_micro_moe, save_micro_qwen3
from test_rollout_server import start_server, stop_server

from mopd_hpc.engines.rollout.client import RolloutClient, RolloutServerError
from mopd_hpc.engines.weight_sync.ipc import (
    IpcUpdateRequest,
    SharedBuffers,
    TensorSlot,
    plan_layout,
    tied_aliases,
)
from mopd_hpc.engines.weight_sync.torch import WeightSyncError
from mopd_hpc.trainer.weight_sync import IpcSync

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class Actor:
    """An actor's `named_weights()` over a transformers model (the HF names the megatron converter gives)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def named_weights(self):
        yield from self.model.state_dict().items()


async def server_weights(client: RolloutClient, names) -> dict[str, torch.Tensor]:
    out = {}
    for name, ref in names.items():
        values = await client.get_weights_by_name(name, truncate_size=ref.numel())
        out[name] = torch.tensor(values, dtype=torch.float32).view(ref.shape)
    return out


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, t in want.items():
        assert torch.equal(got[name], t.detach().float().cpu()), name


def assert_tied_once(sync: IpcSync, model: torch.nn.Module) -> None:
    """The buffer holds each storage of the actor's state_dict once (bytes: the sum of the unique storages),
    and the request still names every weight, a tied head in its embedding's slot."""
    state = model.state_dict()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in state.values()}
    assert sync.buffers.nbytes == sum(storages.values())
    slots = {s.name: s for s in sync.buffers.request("x").tensors}
    assert list(slots) == list(state)
    emb, head = slots["model.embed_tokens.weight"], slots["lm_head.weight"]
    tied = model.config.tie_word_embeddings
    assert len(storages) == len(state) - tied
    assert ((emb.buffer, emb.offset) == (head.buffer, head.offset)) == tied


def test_layout_one_buffer_per_dtype_bucketed():
    specs = [("a", torch.float32, (4, 4)), ("b", torch.bfloat16, (8,)), ("c", torch.float32, (10,))]
    slots, buffers = plan_layout(specs)
    assert buffers == [("float32", 26), ("bfloat16", 8)]
    assert [(s.buffer, s.offset) for s in slots] == [(0, 0), (1, 0), (0, 16)]
    # a 64-byte limit: c (40 bytes) no longer fits after a (64 bytes): a second float32 buffer
    slots, buffers = plan_layout(specs, bucket_bytes=64)
    assert buffers == [("float32", 16), ("bfloat16", 8), ("float32", 10)]
    assert [(s.buffer, s.offset) for s in slots] == [(0, 0), (1, 0), (2, 0)]


def test_layout_puts_an_alias_in_its_targets_slot():
    """A tied name takes the earlier name's slot and no space; an alias of nothing laid out before, or of
    another shape, is refused naming it."""
    specs = [("emb", torch.float32, (4, 2)), ("b", torch.float32, (3,)), ("head", torch.float32, (4, 2))]
    slots, buffers = plan_layout(specs, aliases={"head": "emb"})
    assert buffers == [("float32", 11)]
    assert [(s.name, s.buffer, s.offset, s.shape) for s in slots] == [
        ("emb", 0, 0, (4, 2)), ("b", 0, 8, (3,)), ("head", 0, 0, (4, 2))
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"aliases\['emb'\]='head': expected an earlier weight"):
        plan_layout(specs, aliases={"emb": "head"})
    with pytest.raises(ValueError, match=r"aliases\['b'\]='emb': .* shape \(3,\)"):
        plan_layout(specs, aliases={"b": "emb"})


def test_tied_aliases_are_the_same_view_only():
    """The tied Qwen3's lm_head is its embedding's alias; a clone, another view of one storage (rows of a
    fused weight) and empty tensors are not aliases."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=4, tie_word_embeddings=True)  # fmt: skip
    state = Qwen3ForCausalLM(cfg).state_dict()
    assert tied_aliases(state.items()) == {"lm_head.weight": "model.embed_tokens.weight"}
    state["lm_head.weight"] = state["lm_head.weight"].clone()
    assert tied_aliases(state.items()) == {}
    fused, empty = torch.zeros(4, 3), torch.zeros(0)
    items = [("q", fused[:2]), ("k", fused[2:]), ("q2", fused[:2]), ("e", empty), ("e2", empty)]
    assert tied_aliases(items) == {"q2": "q"}


def test_request_refuses_a_slot_outside_its_buffer():
    buffers = SharedBuffers.allocate([("w", torch.float32, (2, 3))], "cpu")
    try:
        body = buffers.request("1").to_json()
        assert IpcUpdateRequest.from_json(body) == buffers.request("1")
        body["tensors"][0]["shape"] = [3, 3]
        with pytest.raises(ValueError, match=r"weight 'w': float32 elements \[0, 9\) do not lie in buffer 0"):
            IpcUpdateRequest.from_json(body)
    finally:
        buffers.close()
    assert not Path(buffers.handles[0].path).exists()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return save_micro_qwen3(root / "served", seed=0), save_micro_qwen3(root / "trainer", seed=1)


@pytest.mark.parametrize("device", DEVICES)
def test_three_syncs_arrive_bitwise_mapped_once(models, tmp_path, device):
    from transformers import AutoModelForCausalLM

    served, trainer_dir = models
    proc, url, _ = start_server(served, tmp_path, "--device", device)
    model = AutoModelForCausalLM.from_pretrained(trainer_dir, dtype=torch.float32).to(device).eval()
    sync = IpcSync(Actor(model))
    gen = torch.Generator().manual_seed(0)

    async def scenario():
        async with RolloutClient(url, token=TOKEN) as client:
            await sync.start([client])
            before = await server_weights(client, model.state_dict())
            assert not all(torch.equal(before[n], t.cpu()) for n, t in model.state_dict().items())
            for step in (1, 2, 3):
                with torch.no_grad():  # the "train step": every weight changes
                    for p in model.parameters():
                        p.add_(torch.randn(p.shape, generator=gen).to(device) * 0.01)
                await sync.push(step, [client])
                assert_bitwise(await server_weights(client, model.state_dict()), model.state_dict())
                assert (await client.model_info())["weight_version"] == str(step)
                assert set(sync.spans) == {"export", "fill", "post", "copy"}
            # mapped once: one float32 buffer, opened by the first sync only; allocated once by the actor
            assert sync.allocations == 1 and len(sync.buffers.handles) == 1
            assert_tied_once(sync, model)
            answer = await client.update_weights_from_ipc(sync.buffers.request("4").to_json())
            assert answer["buffers_opened"] == 1
            synced = {k: v.detach().clone() for k, v in model.state_dict().items()}

            # a wrong shape (within the buffer) and an unknown name: refused naming the weight, nothing changed
            good = sync.buffers.request("bad")
            first = good.tensors[0]
            numel = first.numel
            for wrong, message in (
                (dataclasses.replace(first, shape=(numel,)), f"weight {first.name!r}: shape \\({numel},\\)"),
                (
                    dataclasses.replace(first, name="model.nope.weight"),
                    "'model.nope.weight': not a parameter",
                ),
            ):
                bad = dataclasses.replace(good, tensors=(wrong, *good.tensors[1:]))
                with pytest.raises(RolloutServerError, match=message) as err:
                    await client.update_weights_from_ipc(bad.to_json())
                assert err.value.status == 400
                assert (await client.model_info())["weight_version"] == "4"
            with torch.no_grad():  # the buffer changes, the refused updates did not copy it in
                for p in model.parameters():
                    p.add_(1.0)
            sync.buffers.fill(model.state_dict().items())
            bad = dataclasses.replace(
                good, tensors=(*good.tensors[:-1], TensorSlot("nope", "float32", (1,), 0, 0))
            )
            with pytest.raises(RolloutServerError, match="'nope': not a parameter"):
                await client.update_weights_from_ipc(bad.to_json())
            assert_bitwise(await server_weights(client, synced), synced)

            # through the sync: a refusal names the step
            sync.engine = Actor(torch.nn.Linear(2, 2).to(device))
            with pytest.raises(WeightSyncError, match="weight sync of step 5: .*not a parameter"):
                await sync.push(5, [client])

        # without the job's token the route answers 401, and nothing is loaded
        async with RolloutClient(url, token=None, retries=0) as anonymous:
            with pytest.raises(RolloutServerError) as err:
                await anonymous.update_weights_from_ipc(good.to_json())
            assert err.value.status == 401
        async with RolloutClient(url, token=TOKEN) as client:
            assert (await client.model_info())["weight_version"] == "4"
        paths = list(sync.buffers.paths)
        await sync.close([])
        assert all(not Path(p).exists() for p in paths)

    try:
        asyncio.run(scenario())
    finally:
        assert stop_server(proc) == 0


@pytest.mark.parametrize("tied", [True, False, "moe", "moe_checkpoint_names"])
def test_the_torch_engine_syncs_tied_and_untied_bitwise(tmp_path, tied):
    """The torch actor engine's `named_weights()` (a tied head under both names) through one sync after a
    train-like change: the server's every parameter is bitwise the actor's, the buffer holds each storage once,
    and in the tied case the server's head still is its embedding; "moe": an untied Qwen3-MoE (its fused expert
    tensors and routers); "moe_checkpoint_names": the same with each expert under its checkpoint name (views of the
    fused tensors, `engines/expert_names.CheckpointNames`), as a megatron actor sends them and SGLang loads them,
    loaded into the served model's fused experts (`engines/expert_names.py`)."""
    from mopd_hpc.config import LossConfig
    from mopd_hpc.config.models import OptimizerConfig
    from mopd_hpc.engines.expert_names import CheckpointNames
    from mopd_hpc.engines.torch.engine import TorchTrainEngine

    names = tied
    if tied in ("moe", "moe_checkpoint_names"):
        served, trainer_dir = save_micro_moe(tmp_path / "served", 0), save_micro_moe(tmp_path / "trainer", 1)
        tied = False
    else:
        served = save_micro_qwen3(tmp_path / "served", seed=0, tied=tied)
        trainer_dir = save_micro_qwen3(tmp_path / "trainer", seed=1, tied=tied)
    actor = TorchTrainEngine.from_pretrained(
        trainer_dir, dtype="float32", device="cpu", optimizer=OptimizerConfig(lr=1e-3), loss=LossConfig()
    )
    with torch.no_grad():  # the head and the embedding differ unless they are one tensor
        actor.model.lm_head.weight.mul_(2.0)
    proc, url, _ = start_server(served, tmp_path)
    sync = IpcSync(CheckpointNames(actor) if names == "moe_checkpoint_names" else actor)

    async def scenario():
        async with RolloutClient(url, token=TOKEN) as client:
            await sync.push(1, [client])
            if names == "moe_checkpoint_names":
                assert "model.layers.1.mlp.experts.3.up_proj.weight" in {
                    s.name for s in sync.buffers.request("x").tensors
                }
            else:
                assert_tied_once(sync, actor.model)
            want = actor.model.state_dict()
            got = await server_weights(client, want)
            assert_bitwise(got, want)
            emb, head = got["model.embed_tokens.weight"], got["lm_head.weight"]
            assert torch.equal(emb, head) == tied
        await sync.close([])

    try:
        asyncio.run(scenario())
    finally:
        assert stop_server(proc) == 0


def test_rank_map_shows_the_buffer_owner_and_its_readers():
    from mopd_hpc.launch.rankmap import ipc_cell

    cells = [
        ipc_cell(r, i)
        for r, i in (("actor", 0), ("actor", 1), ("rollout", 0), ("rollout", 3), ("teacher", 0))
    ]
    assert cells == ["buffer (source)", "-", "reader", "reader", "-"]
