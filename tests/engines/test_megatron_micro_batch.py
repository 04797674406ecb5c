"""The megatron engine's micro-batch loop on CPU: `MegatronTrainEngine.train_step` with its DDP, optimizer and
grad sync replaced by recording stand-ins and GPTModel's labels path by an HF model (float64), so that the
loop itself — the step's denominator computed once, one backward per micro-batch accumulating gradients, all
but the last under `no_sync()`, one `finalize_model_grads`, statistics combined — is checked against one
micro-batch exactly (1e-10). On a GPU, tests/engines/test_microbatch_gpu.py runs the real megatron-core engine.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers_models import save_micro_qwen3

from mopd_hpc.config.loss import LossConfig
from mopd_hpc.engines.batch import TokenBatch, TrainBatch
from mopd_hpc.engines.data_parallel import DataParallel
from mopd_hpc.engines.micro_batch import MicroBatching
from mopd_hpc.engines.torch.hf_model import load_causal_lm
from mopd_hpc.mopd.targets import TeacherTargets

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [2, 4, 6], [3, 5]]
OUTPUTS = [[11, 12, 13, 14], [15], [], [18, 19, 20], [21, 22, 23, 24, 25], [26, 27]]


class StandInGPT(torch.nn.Module):
    """GPTModel's labels path over an HF causal LM: `model(ids, positions, None, labels=...)` → [B, L]
    −log π(label)."""

    def __init__(self, hf: torch.nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: None, labels: torch.Tensor) -> Any:
        logp = torch.log_softmax(self.hf(input_ids=ids).logits, -1)
        return -logp.gather(-1, labels[..., None]).squeeze(-1)


@pytest.fixture(scope="module")
def engine_module():
    pytest.importorskip("megatron.core", reason="megatron-core (the megatron extra) is not installed")
    from mopd_hpc.engines.megatron import engine

    return engine


@pytest.fixture(scope="module")
def student(tmp_path_factory) -> Path:
    return save_micro_qwen3(tmp_path_factory.mktemp("mmb") / "student", 0, initializer_range=0.2)


def make_actor(engine_module: Any, student: Path, monkeypatch, normalizer: str, budget: int | None) -> Any:
    """A MegatronTrainEngine over stand-ins; `actor.calls` records no_sync entries and grad syncs."""
    import megatron.core.distributed as mcore_distributed

    calls: list[str] = []
    monkeypatch.setattr(mcore_distributed, "finalize_model_grads", lambda models: calls.append("finalize"))

    @contextlib.contextmanager
    def no_sync():
        calls.append("no_sync")
        yield

    hf = load_causal_lm(student, "float32", torch.device("cpu")).double().requires_grad_(True)
    actor = object.__new__(engine_module.MegatronTrainEngine)
    actor.device, actor.steps = torch.device("cpu"), 0
    actor.loss_config = LossConfig(normalizer=normalizer, correction="mask")
    actor.micro_batching = MicroBatching(budget)
    actor.ddp = SimpleNamespace(train=lambda: None, zero_grad_buffer=lambda: None, no_sync=no_sync)
    actor.optimizer = SimpleNamespace(
        zero_grad=lambda: None, step=lambda: (True, 0.5, None), param_groups=[{"lr": 1e-5}]
    )
    actor.scheduler = SimpleNamespace(step=lambda increment: None)  # megatron's lr scheduler: nothing to set
    actor.forward = engine_module.MegatronForward(StandInGPT(hf), actor.device)
    actor.residency = SimpleNamespace(on_device=True)
    actor.data_parallel = DataParallel.single()  # DP 1: the step's own token count is the whole step's
    actor.calls, actor.hf = calls, hf
    return actor


def recorded_batch() -> TrainBatch:
    tokens = TokenBatch.from_samples(PROMPTS, OUTPUTS, pad_id=0)
    gen = torch.Generator().manual_seed(3)
    shape = (tokens.batch_size, tokens.response_width)
    mask = tokens.response_mask
    mu = torch.where(mask, -2.0 + 0.5 * torch.randn(shape, generator=gen), 0.0)
    s = torch.where(mask, -1.5 + 0.5 * torch.randn(shape, generator=gen), 0.0)
    return TrainBatch.create(tokens, mu, targets=TeacherTargets(s, torch.ones(shape)))


@pytest.mark.parametrize("normalizer", ["token-mean", "seq-mean-token-mean"])
def test_megatron_micro_batch_loop_gives_the_one_batch_step(engine_module, student, monkeypatch, normalizer):
    batch = recorded_batch()
    runs = {}
    # Lengths 7, 3, 4, 4, 8, 4 → None: 1 micro-batch; 16: [8, 7] [4, 4, 4, 3]; 8: [8] [7] [4, 4] [4, 3].
    for budget, count in ((None, 1), (16, 2), (8, 4)):
        actor = make_actor(engine_module, student, monkeypatch, normalizer, budget)
        seen: list[torch.Tensor] = []
        stats = actor.train_step(batch, observe=lambda lp, seen=seen: seen.append(lp) or {})
        assert stats["micro_batches"] == count
        parts = [stats["time/train/forward_backward_s"], stats["time/train/optimizer_s"]]  # seconds
        assert all(math.isfinite(s) and s >= 0 for s in parts) and parts[0] > 0, parts
        assert actor.calls == ["no_sync"] * (count - 1) + ["finalize"], actor.calls
        grads = torch.cat([p.grad.flatten() for p in actor.hf.parameters()])
        runs[budget] = (stats, grads, seen[0])
    want, g1, lp1 = runs[None]
    assert g1.norm() > 0
    for budget in (16, 8):
        got, g, lp = runs[budget]
        assert float((g - g1).norm() / g1.norm()) <= 1e-10, budget
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-10)
        assert got["tokens"] == want["tokens"] == float(sum(map(len, OUTPUTS)))
        assert torch.allclose(lp, lp1, rtol=0, atol=1e-6)  # observe sees the rows in their order
        for key in want:
            if key != "micro_batches" and not key.startswith("time/"):  # seconds differ per run
                assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), key
