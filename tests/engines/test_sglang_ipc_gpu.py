"""The ipc weight sync into a real SGLang engine on one GPU (needs CUDA and sglang: the device; skipped here).

Real parts: SGLang 0.5.17's `sglang.Engine` over a random Qwen3-0.6B shape (`benchmarks/gpu_models.py`, seed
0), built and called on the server's engine thread (`engine_thread.py`) behind the job's token; this process is
the actor: `IpcSync` over the seed-1 checkpoint's weights on the GPU (CUDA IPC buffers), whose references
SGLang's scheduler process opens (`sglang_ipc.py`). The phase order of a colocated step: release every tag,
resume the weights, the sync, resume the KV cache and CUDA graphs, then the rollouts. Oracle: a direct bf16
forward of the seed-1 checkpoint: the behavior log-probs μ of the sampled tokens at T = 0.7 within the HF
server test's tolerance (tests/engines/test_rollout_server.py CUDA_BF16_TOL, 0.1 nats; 0.045 measured on the H100
probe), far from the seed-0 weights' (the update took), each rollout naming the step's weight_version.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from aiohttp import test_utils
from helpers_auth import TOKEN
from helpers_ports import free_ports
from test_rollout_server import CUDA_BF16_TOL, oracle_logprobs

from mopd_hpc.config.rollout import SamplingConfig
from mopd_hpc.engines.rollout.client import RolloutClient
from mopd_hpc.engines.rollout.engine_thread import EngineThread
from mopd_hpc.engines.rollout.sglang_backend import SGLangLaunch
from mopd_hpc.engines.rollout.sglang_server import SGLangRolloutServer, sglang_app, start_engine
from mopd_hpc.trainer.rollout_memory import CACHE_TAGS, RELEASED_TAGS, SYNC_TAGS
from mopd_hpc.trainer.rollout_phase import generate
from mopd_hpc.trainer.weight_sync import IpcSync

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.sglang,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed"),
]
ROWS, NEW_TOKENS, TEMPERATURE = 8, 24, 0.7


class Actor:
    """The actor's `named_weights()`: the HF state dict of a model on the GPU."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def named_weights(self):
        yield from self.model.state_dict().items()


def test_ipc_sync_into_a_released_sglang_engine_gives_mu_of_the_new_weights(tmp_path: Path) -> None:
    from gpu_models import SHAPES, make_checkpoint
    from transformers import AutoModelForCausalLM

    make_checkpoint(SHAPES["0.6b"], tmp_path / "student", seed=0)
    make_checkpoint(SHAPES["0.6b"], tmp_path / "other", seed=1)
    other = AutoModelForCausalLM.from_pretrained(tmp_path / "other", dtype=torch.bfloat16).cuda().eval()
    http, nccl, dist_init = free_ports(3)
    launch = SGLangLaunch.from_ports(
        str(tmp_path / "student"), {"http": http, "nccl": nccl, "dist_init": dist_init},
        mem_fraction_static=0.35, cuda_graph_max_bs=ROWS,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, SHAPES["0.6b"]["vocab_size"], (16,), generator=g).tolist() for _ in range(ROWS)
    ]

    async def scenario() -> list:
        thread = EngineThread()
        engine = await thread.call(start_engine, launch)
        try:
            server = SGLangRolloutServer(launch, engine, thread)
            async with (
                test_utils.TestServer(sglang_app(server, TOKEN), host="127.0.0.1") as ts,
                RolloutClient(f"http://127.0.0.1:{ts.port}", token=TOKEN, retries=0) as client,
            ):
                sync = IpcSync(Actor(other))
                await client.release(list(RELEASED_TAGS))  # a colocated step: ROLLOUT ends
                await client.resume_memory(list(SYNC_TAGS))  # SYNC: weights back (garbage until loaded)
                await sync.push(1, [client])
                await client.resume_memory(list(CACHE_TAGS))
                sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=TEMPERATURE)
                samples = await generate([client], prompts, sampling, n=1, seeds=list(range(ROWS)))
                print(f"ipc sync spans {sync.spans}")
                await sync.close([client])
                return samples
        finally:
            await thread.call(engine.shutdown)
            thread.close()

    samples = asyncio.run(scenario())
    student = AutoModelForCausalLM.from_pretrained(tmp_path / "student", dtype=torch.bfloat16).cuda().eval()
    worst, worst_old = 0.0, 0.0
    for sample in samples:
        assert sample.weight_version == "1" and len(sample.behavior_logprobs) == len(sample.output_ids) > 0
        ids, n = list(sample.prompt_ids) + list(sample.output_ids), len(sample.prompt_ids)
        got = torch.tensor(sample.behavior_logprobs)
        for model, name in ((other, "new"), (student, "old")):
            ref = oracle_logprobs(model, ids, TEMPERATURE, "cuda")
            expected = torch.tensor([float(ref[n - 1 + t, tok]) for t, tok in enumerate(sample.output_ids)])
            delta = float((got - expected).abs().max())
            worst, worst_old = (
                (max(worst, delta), worst_old) if name == "new" else (worst, max(worst_old, delta))
            )
    print(f"SGLang after the ipc sync vs direct forward, T={TEMPERATURE}: largest |Δ log μ| {worst:.4f} nats "
          f"(against the old weights {worst_old:.3f})")  # fmt: skip
    assert worst <= CUDA_BF16_TOL
    assert worst_old > 10 * CUDA_BF16_TOL  # the engine's own (seed-0) weights are not what sampled
