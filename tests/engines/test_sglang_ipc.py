"""The ipc weight sync into a colocated sglang rollout engine (engines/rollout/sglang_ipc.py): the actor's shared
buffers reach SGLang's `Engine.update_weights_from_tensor` as references its TP workers open.

Real parts: the trainer's `IpcSync` (this process is the actor: a /dev/shm buffer on CPU), the sglang rollout
role's aiohttp server behind the job's token, the trainer's rollout client and rollout phase. The Engine is a
stand-in with SGLang 0.5.17's `update_weights_from_tensor(named_tensors, load_format=None, flush_cache=True)`
doing what SGLang does with them (srt/entrypoints/engine.py, srt/utils/common.py): pickle them with torch's
ForkingPickler once per TP rank (`MultiprocessingSerializer.serialize`), unpickle each copy with SGLang's
allow-list of modules (`SafeUnpickler`: the prefixes below are 0.5.17's that the payload may use) and load them
by HF name. Oracle: the actor's own tensors, bit for bit, in every TP worker, after each of two syncs; the
weight_version answered with every generated item is the step's (the server's: SGLang 0.5.17 answers
"default"), and weights resumed after a release serve no rollout until an update has loaded them.
"""

from __future__ import annotations

import asyncio
import io
import pickle
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers_auth import TOKEN, write_run_dir_token
from helpers_ports import free_ports
from test_rollout_role_sglang import TP, TPStandIn, role_env, sglang_config, start_role

from mopd_hpc.config.rollout import SamplingConfig, WeightSyncConfig
from mopd_hpc.config.serving_refusals import weight_sync_refusals
from mopd_hpc.engines.rollout.client import RolloutClient, RolloutServerError
from mopd_hpc.engines.rollout.sglang_ipc import IpcTensorRef, named_refs
from mopd_hpc.engines.weight_sync.ipc import BufferHandle, IpcUpdateRequest, TensorSlot
from mopd_hpc.trainer.rollout_phase import generate
from mopd_hpc.trainer.weight_sync import IpcSync

#: SGLang 0.5.17 SafeUnpickler.ALLOWED_MODULE_PREFIXES, the ones a weight payload can need.
SGLANG_ALLOWED = (
    "builtins.",
    "collections.",
    "copyreg.",
    "functools.",
    "torch.",
    "multiprocessing.reduction.",
)


class SafeUnpickler(pickle.Unpickler):
    """SGLang's rule: a module outside the allow-list is refused (`(module + ".").startswith(prefix)`)."""

    def find_class(self, module: str, name: str) -> Any:
        if not any((module + ".").startswith(p) for p in SGLANG_ALLOWED):
            raise RuntimeError(f"Blocked unsafe class loading ({module}.{name})")
        return super().find_class(module, name)


class IpcStandIn(TPStandIn):
    """The TP stand-in with SGLang 0.5.17's update_weights_from_tensor (module docstring); `loaded[r]` is TP
    worker r's weights, by HF name."""

    def __init__(self, launch: Any) -> None:
        super().__init__(launch)
        self.loaded: list[dict[str, torch.Tensor]] = [{} for _ in range(launch.tp_size)]
        self.payload_bytes = 0

    def update_weights_from_tensor(
        self, named_tensors: list[tuple[str, Any]], load_format: str | None = None, flush_cache: bool = True
    ) -> tuple[bool, str]:
        self.on_its_thread()
        self.calls.append(("update_tensor", {"load_format": load_format, "flush_cache": flush_cache}))
        payloads = []
        for _ in range(self.launch.tp_size):  # MultiprocessingSerializer.serialize, once per rank
            buf = io.BytesIO()
            ForkingPickler(buf).dump(named_tensors)
            payloads.append(buf.getvalue())
        self.payload_bytes = len(payloads[0])
        for rank, payload in enumerate(payloads):  # each TP worker: deserialize, then model.load_weights
            for name, tensor in SafeUnpickler(io.BytesIO(payload)).load():
                assert isinstance(tensor, torch.Tensor), (name, type(tensor))
                self.loaded[rank][name] = tensor.clone()
        return True, "Success"


class Actor:
    """An actor's `named_weights()`: HF names, two dtypes, a tied head (the embedding's tensor)."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        emb = torch.randn(7, 4, generator=gen)
        self.weights = {
            "model.embed_tokens.weight": emb,
            "model.layers.0.mlp.up_proj.weight": torch.randn(6, 4, generator=gen).to(torch.bfloat16),
            "model.norm.weight": torch.rand(4, generator=gen),
            "lm_head.weight": emb,
        }

    def named_weights(self) -> Any:
        return iter(self.weights.items())


def test_ipc_and_colocated_sglang_are_accepted_on_gpu() -> None:
    assert list(weight_sync_refusals("ipc", "torch", "sglang", "colocated", "gpu")) == []
    assert list(weight_sync_refusals("ipc", "megatron", "sglang", "colocated", "gpu")) == []
    (separated,) = weight_sync_refusals("ipc", "torch", "sglang", "separated", "gpu")
    assert "rollout.mode: colocated" in separated.render()


def test_shared_buffers_reach_every_tp_worker_with_the_steps_version(tmp_path: Path) -> None:
    write_run_dir_token(tmp_path)
    role = role_env(tmp_path, free_ports(3))
    cfg = sglang_config()
    cfg = cfg.model_copy(update={"weight_sync": WeightSyncConfig(backend="ipc")})

    async def scenario() -> None:
        task, stop, record, engine = await start_role(role, cfg, IpcStandIn)
        actor = Actor()
        sync = IpcSync(actor)
        assert len(engine.loaded) == TP
        async with RolloutClient(record["url"], token=TOKEN, retries=0) as client:
            for step in (1, 2):
                if step == 2:  # the actor trained: new values in place, the same layout
                    for t in actor.weights.values():
                        t.mul_(-2.0).add_(0.5)
                await sync.push(step, [client])
                for worker in engine.loaded:  # every TP worker holds every weight, bit for bit
                    # the tied head under its first name only: SGLang's model ties it itself
                    assert list(worker) == [name for name in actor.weights if name != "lm_head.weight"]
                    for name, value in worker.items():
                        want = actor.weights[name]
                        assert value.dtype == want.dtype and torch.equal(value, want), name
                assert engine.calls[-1] == ("update_tensor", {"load_format": None, "flush_cache": True})
                sampling = SamplingConfig(max_new_tokens=2, temperature=1.0)
                (sample,) = await generate([client], [[3, 4]], sampling, n=1, seeds=[step])
                assert sample.weight_version == str(step)  # the weights that sampled it (the server's)
                assert sample.behavior_logprobs == (-0.5, -0.75)  # μ with every rollout
                assert (await client.model_info())["weight_version"] == str(step)
            assert sync.allocations == 1 and set(sync.spans) == {"export", "fill", "post", "copy"}
            assert engine.payload_bytes < 4096  # references, not the weights' bytes
            bad = sync.buffers.request("3").to_json()
            bad["tensors"][0]["offset"] = 10**6  # outside its buffer: refused, nothing loaded
            with pytest.raises(RolloutServerError, match="do not lie in buffer"):
                await client.update_weights_from_ipc(bad)
            assert engine.calls[-1][0] == "generate"
            # resumed weights are garbage (SGLang's memory saver keeps no copy): no rollout until an update
            await client.release(["weights"])
            await client.resume_memory(["weights"])
            with pytest.raises(RolloutServerError, match="resumed but not loaded"):
                await generate([client], [[3, 4]], sampling, n=1, seeds=[3])
            await sync.push(3, [client])
            (sample,) = await generate([client], [[3, 4]], sampling, n=1, seeds=[3])
            assert sample.weight_version == "3"
            await sync.close([client])
        stop.set()
        await task

    asyncio.run(scenario())


REBUILDS: list[tuple[Any, ...]] = []


def record_rebuild(*args: Any) -> str:
    """Stands for torch's rebuild_cuda_tensor (no CUDA here): records its arguments."""
    REBUILDS.append(args)
    return "opened"


def test_a_cuda_buffer_pickles_as_torchs_rebuild_of_the_slot(monkeypatch) -> None:
    """On GPU a reference is the call a pickled CUDA view of the actor's buffer is: torch's
    rebuild_cuda_tensor(Tensor, size, stride, offset, TypedStorage, dtype, device, handle, ...), the offset
    the slot's elements past the buffer's, whichever function torch's reductions hold (SGLang patches them)."""
    from torch.multiprocessing import reductions

    REBUILDS.clear()
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", record_rebuild)
    handle = BufferHandle(
        "b0", "cuda", "bfloat16", 100, device=3, handle="ab" * 8, storage_size_bytes=512,
        storage_offset_bytes=64, ref_counter_handle="cd" * 4, ref_counter_offset=2, tensor_offset=5,
    )  # fmt: skip
    req = IpcUpdateRequest((handle,), (TensorSlot("w", "bfloat16", (3, 4), 0, 20),), "7")
    ((name, ref),) = named_refs(req)
    assert name == "w" and isinstance(ref, IpcTensorRef)
    assert pickle.loads(pickle.dumps([ref])) == ["opened"]
    (args,) = REBUILDS
    assert args[1:4] == (torch.Size([3, 4]), (4, 1), 25)  # size, contiguous stride, 5 + 20 elements
    assert args[5:10] == (torch.bfloat16, 3, bytes.fromhex("ab" * 8), 512, 64)
    assert args[10:15] == (False, bytes.fromhex("cd" * 4), 2, None, False)
