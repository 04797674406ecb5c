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


def test_sglang_names_are_the_checkpoint_files_names_as_views(tmp_path: Path) -> None:
    """SGLang's Qwen3-MoE loader reads the checkpoint files' names: `CheckpointNames(engine).named_weights()` of an
    engine holding transformers 5's fused experts gives exactly the names of the model's safetensors file, each
    tensor bitwise the file's, the experts as views of the fused parameters (no copy); a dense model's and
    megatron's (already per expert) names pass unchanged; `build_sync` wraps the actor for an sglang rollout."""
    from safetensors.torch import load_file

    from mopd_hpc.engines.expert_names import CheckpointNames, checkpoint_named

    path = save_micro_moe(tmp_path / "moe", 0)
    model = HFRolloutEngine.load(str(path), "cpu", "float32").model

    class Engine:
        device = "cpu"

        def named_weights(self):
            return iter(model.state_dict().items())

    named = dict(CheckpointNames(Engine()).named_weights())
    files = load_file(str(path / "model.safetensors"))
    assert list(named) != list(model.state_dict()) and set(named) == set(files)
    for key, t in files.items():
        assert torch.equal(named[key], t), key
    fused = model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"]
    assert named["model.layers.0.mlp.experts.1.up_proj.weight"].untyped_storage().data_ptr() == (
        fused.untyped_storage().data_ptr()
    )
    assert CheckpointNames(Engine()).device == "cpu"
    assert list(checkpoint_named(files.items())) == list(files.items())  # already per expert: unchanged


def test_build_sync_names_experts_for_sglang() -> None:
    from types import SimpleNamespace

    from mopd_hpc.engines.expert_names import CheckpointNames
    from mopd_hpc.trainer.weight_sync import IpcSync, SyncSettings, TorchSync, build_sync

    engine, settings = object(), SyncSettings("127.0.0.1", 1)
    for rollout, sync_backend, kind in (
        ("hf", "ipc", IpcSync),
        ("sglang", "ipc", IpcSync),
        ("sglang", "torch", TorchSync),
    ):
        cfg = SimpleNamespace(
            weight_sync=SimpleNamespace(backend=sync_backend),
            rollout=SimpleNamespace(backend=rollout, engines=SimpleNamespace(tensor_parallel=1)),
        )
        sync = build_sync(cfg, engine, settings, "/nonexistent")
        assert isinstance(sync, kind)
        if rollout == "sglang":
            assert isinstance(sync.engine, CheckpointNames) and sync.engine.engine is engine
        else:
            assert sync.engine is engine
