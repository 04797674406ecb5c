"""The megatron engine's data-parallel step on CPU (issue 18): `MegatronTrainEngine.train_step` at DP = 2 over
two real gloo processes computes the DP = 1 update. megatron's GPTModel and DDP need CUDA, so the model is
the HF-backed stand-in of tests/engines/test_actor_engine_choice.py (GPTModel's labels path over a transformers Qwen3)
and DDP's gradient reduction is a stand-in that does what megatron's does by default: all-reduce and divide by
the DP size (`gradient_scaling_factor` 1/DP). What is under test is the engine's own part: the whole step's
denominator and token count summed over the DP group, the loss scaled by DP before backward, the statistics
reduced as the torch engine's. Oracle: the same step at DP = 1 on all rows (gradients within 1e-6, float32;
loss and statistics within 1e-6 relative).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from helpers_models import save_micro_qwen3
from helpers_ports import free_port
from helpers_ranks import run_ranks

_RANK = textwrap.dedent(
    """
    import contextlib, json, sys
    from types import SimpleNamespace
    import torch, torch.distributed as dist
    import megatron.core.distributed as mcore_distributed
    from mopd_hpc.config.loss import LossConfig
    from mopd_hpc.engines.batch import TokenBatch, TrainBatch
    from mopd_hpc.engines.data_parallel import DataParallel
    from mopd_hpc.engines.megatron import engine as megatron_engine
    from mopd_hpc.engines.micro_batch import MicroBatching
    from mopd_hpc.engines.torch.scoring import TorchScoringEngine
    from mopd_hpc.mopd.targets import TeacherTargets
    from mopd_hpc.trainer.shards import shard_rows

    rank, world, port, student, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    hf = TorchScoringEngine.from_pretrained(student, dtype="float32", device="cpu").model.requires_grad_(True)

    class StandInGPT(torch.nn.Module):
        def __init__(self, hf):
            super().__init__()
            self.hf = hf

        def forward(self, ids, positions, mask, labels):
            logp = torch.log_softmax(self.hf(input_ids=ids).logits.float(), -1)
            return -logp.gather(-1, labels[..., None]).squeeze(-1)

    def finalize(models):  # megatron DDP's default: the DP ranks' gradients averaged
        if world > 1:
            for p in hf.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world

    mcore_distributed.finalize_model_grads = finalize
    actor = object.__new__(megatron_engine.MegatronTrainEngine)
    actor.device, actor.loss_config, actor.steps = torch.device("cpu"), LossConfig(), 0
    actor.ddp = SimpleNamespace(train=lambda: None, zero_grad_buffer=lambda: None, no_sync=contextlib.nullcontext)
    actor.micro_batching = MicroBatching()
    actor.optimizer = SimpleNamespace(zero_grad=lambda: None, step=lambda: (True, 0.5, None), param_groups=[{"lr": 1e-5}])
    actor.scheduler = SimpleNamespace(step=lambda increment: None)
    actor.forward = megatron_engine.MegatronForward(StandInGPT(hf), actor.device)
    actor.residency = SimpleNamespace(on_device=True)
    actor.data_parallel = DataParallel(rank, world) if world > 1 else DataParallel.single()

    rows = [[1, 2, 3, 11, 12, 13], [4, 5, 15], [6, 7, 8, 9, 16, 17, 18, 19], [3, 9, 10, 11, 12]]
    starts = [3, 2, 4, 1]
    shard = shard_rows([len(r) - s for r, s in zip(rows, starts)], world)[rank]
    lo, hi = shard.start, shard.stop
    tokens = TokenBatch.from_rows(rows[lo:hi], starts[lo:hi], pad_id=0)
    g = torch.Generator().manual_seed(3)
    full_behavior = -torch.rand(4, 4, generator=g) * 3
    full_target = -torch.rand(4, 4, generator=g) * 3
    width = tokens.response_width
    targets = TeacherTargets(full_target[lo:hi, :width].clone(), torch.ones(hi - lo, width))
    batch = TrainBatch.create(tokens, full_behavior[lo:hi, :width].clone(), targets=targets)
    stats = actor.train_step(batch, observe=lambda lp: {"observed/mean": float(lp[tokens.response_mask].mean())})
    torch.save({n: p.grad.clone() for n, p in hf.named_parameters()}, f"{out}/grads_w{world}_r{rank}.pt")
    with open(f"{out}/stats_w{world}_r{rank}.json", "w") as f:
        json.dump(stats, f)
    """
)


def _ranks(world: int, student: Path, out: Path) -> None:
    port = free_port()
    run_ranks(_RANK, lambda r: (str(r), str(world), str(port), str(student), str(out)), world)


def test_dp2_train_step_computes_the_dp1_update(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core (the megatron extra) is not installed")
    student = save_micro_qwen3(tmp_path / "student", seed=5, vocab_size=24)
    _ranks(1, student, tmp_path)
    _ranks(2, student, tmp_path)
    one = json.loads((tmp_path / "stats_w1_r0.json").read_text())
    twos = [json.loads((tmp_path / f"stats_w2_r{r}.json").read_text()) for r in range(2)]
    assert set(one) == set(twos[0]) == set(twos[1])
    # every rank reports the whole step's values, but the seconds of its parts: each rank's own
    one, *twos = ({k: v for k, v in s.items() if not k.startswith("time/")} for s in (one, *twos))
    assert twos[0] == twos[1]
    assert twos[0]["tokens"] == one["tokens"] == 12.0  # the whole step's response tokens
    for key, value in one.items():
        if key == "micro_batches":
            continue
        assert twos[0][key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
    g1 = torch.load(tmp_path / "grads_w1_r0.pt")
    for r in range(2):
        g2 = torch.load(tmp_path / f"grads_w2_r{r}.pt")
        for name, grad in g1.items():
            assert grad.abs().max() > 0, name
            torch.testing.assert_close(g2[name], grad, rtol=1e-5, atol=1e-6, msg=name)
