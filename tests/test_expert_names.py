"""A fused MoE layer's experts loaded under their checkpoint names (engines/expert_names.py): the HF rollout
engine's `load_named_tensors` with megatron's export names (`convert_moe.split_fused_experts`) gives the
other model's every tensor bitwise; an expert the model lacks is refused and nothing changes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers_models import MOE_EXPERTS, save_micro_moe

from mopd_hpc.engines.expert_names import expert_views
from mopd_hpc.engines.megatron.convert_moe import split_fused_experts
from mopd_hpc.engines.rollout.hf_engine import HFRolloutEngine, WeightLoadError


def test_checkpoint_names_load_into_fused_experts_bitwise(tmp_path: Path) -> None:
    engine = HFRolloutEngine.load(str(save_micro_moe(tmp_path / "served", 0)), "cpu", "float32")
    other = HFRolloutEngine.load(str(save_micro_moe(tmp_path / "other", 1)), "cpu", "float32").model
    named = split_fused_experts(other.state_dict())
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in named
    assert not any(k.endswith("gate_up_proj") for k in named)
    assert engine.load_named_tensors(named, "2") == len(named)
    got, want = engine.model.state_dict(), other.state_dict()
    assert set(got) == set(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key

    state = engine.model.state_dict(keep_vars=True)
    views = expert_views(state, ["model.layers.0.mlp.experts.2.up_proj.weight", "model.norm.weight"])
    assert list(views) == ["model.layers.0.mlp.experts.2.up_proj.weight"]  # a name the model holds: itself
    half = state["model.layers.0.mlp.experts.gate_up_proj"].shape[1] // 2
    assert views["model.layers.0.mlp.experts.2.up_proj.weight"].data_ptr() == (
        state["model.layers.0.mlp.experts.gate_up_proj"].data[2, half:].data_ptr()
    )

    before = {k: v.clone() for k, v in got.items()}
    bad = {"model.norm.weight": torch.zeros_like(got["model.norm.weight"]),
           f"model.layers.0.mlp.experts.{MOE_EXPERTS}.down_proj.weight": named["model.layers.0.mlp.experts.0.down_proj.weight"]}  # fmt: skip
    with pytest.raises(WeightLoadError, match=rf"experts\.{MOE_EXPERTS}\.down_proj"):
        engine.load_named_tensors(bad, "3")
    assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in before.items())
