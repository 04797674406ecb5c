"""CPU parts of the Megatron actor's residency (issue 8): which tensors are the optimizer state, and the parts
argument. The moves themselves need CUDA (tests/engines/test_megatron_residency_gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mopd_hpc.engines.megatron.residency import DDPResidency, optimizer_tensors


def _adam_after_one_step(*params: torch.nn.Parameter) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return opt


def test_optimizer_tensors_of_a_chained_megatron_optimizer() -> None:
    """ChainedOptimizer → children (DistributedOptimizer-like, `.optimizer` = the torch one): every main param
    and its Adam moments, each once (a param shared by two groups counted once)."""
    a, b, c = (torch.nn.Parameter(torch.zeros(n)) for n in (3, 4, 5))
    first, second = _adam_after_one_step(a, b), _adam_after_one_step(c)
    chained = SimpleNamespace(
        chained_optimizers=[SimpleNamespace(optimizer=first), SimpleNamespace(optimizer=second)]
    )
    found = list(optimizer_tensors(chained))
    expected = [a, first.state[a]["exp_avg"], first.state[a]["exp_avg_sq"], b, first.state[b]["exp_avg"],
                first.state[b]["exp_avg_sq"], c, second.state[c]["exp_avg"], second.state[c]["exp_avg_sq"]]  # fmt: skip
    assert [id(t) for t in found if t.dim() > 0] == [id(t) for t in expected]
    assert list(optimizer_tensors(SimpleNamespace(optimizer=first))) == list(optimizer_tensors(
        SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=first)])))  # fmt: skip
    assert list(optimizer_tensors(SimpleNamespace())) == []  # no inner optimizer: nothing to move


def test_parts_are_checked_before_anything_moves() -> None:
    residency = DDPResidency(SimpleNamespace(buffers=[]), None, torch.device("cpu"))
    for bad in ((), ("kv_cache",), ("weights", "grads")):
        with pytest.raises(ValueError, match="expected a non-empty subset of"):
            residency.offload(bad)
        with pytest.raises(ValueError, match="expected a non-empty subset of"):
            residency.onload(bad)
    assert residency.on_device and residency.resident == {"optimizer": True, "weights": True}
