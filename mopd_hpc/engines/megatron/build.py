"""The megatron backend's model build/load path (DESIGN.md §5): an HF checkpoint directory read
(`read_hf_checkpoint`) and turned into this TP rank's GPTModel (`build_from_hf`: `convert.hf_to_mcore`,
`convert.shard_tp`, `model.build_gpt_model`), the RoPE base of an HF config (`rope_theta`). The actor's
engine (`engine.py`) and the teacher's (`scoring.py`) both build through it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mopd_hpc.engines.megatron import parallel
from mopd_hpc.engines.megatron.convert import Qwen3Shape, hf_to_mcore, shard_tp
from mopd_hpc.engines.megatron.expert_parallel import ep_info, shard_experts, token_dispatcher
from mopd_hpc.engines.megatron.model import DTYPES, build_gpt_model, load_mcore_state
from mopd_hpc.engines.megatron.rope import megatron_rope_scaling
from mopd_hpc.engines.protocol import EngineError


def read_hf_checkpoint(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json as a dict, the state dict from every *.safetensors file) of an HF checkpoint directory."""
    from safetensors.torch import load_file

    root = Path(path)
    config = json.loads((root / "config.json").read_text())
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise EngineError(f"{root}: no *.safetensors files; expected an HF checkpoint")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return config, state


def build_from_hf(
    path: str | Path | None, hf_config: Mapping[str, Any], dtype: str, device: torch.device
) -> tuple[torch.nn.Module, Qwen3Shape]:
    """This TP rank's GPTModel on `device`, with the checkpoint's weights (path None: random init); at
    megatron expert-parallel size EP > 1 this EP rank's E/EP experts of each MoE layer (expert_parallel.py).

    Raises:
        EngineError: tensor_parallel does not divide the vocabulary, or EP > 1 does not divide the expert
            count (a dense model included).
    """
    tp, rank, _ = parallel.tp_info()
    ep, ep_rank, _ = ep_info()
    shape = Qwen3Shape.from_hf_config(hf_config)
    if shape.vocab_size % tp:
        raise EngineError(f"vocab_size={shape.vocab_size} is not divisible by tensor_parallel={tp}")
    if ep > 1 and (not shape.moe_layers or shape.num_experts % ep):
        raise EngineError(
            f"models.actor.expert_parallel={ep}: the model has {shape.num_experts} experts a MoE layer; expected "
            "a mixture of experts whose expert count it divides"
        )
    eps = float(hf_config.get("rms_norm_eps", 1e-6))
    theta = rope_theta(hf_config)
    scaling = megatron_rope_scaling(hf_config)  # Llama 3.x (engines/megatron/rope.py)
    model = build_gpt_model(
        shape, dtype, tp, rope_theta=theta, layernorm_epsilon=eps, rope_scaling_factor=scaling,
        expert_parallel=ep, token_dispatcher=token_dispatcher(ep, device.type),
    ).to(device)  # fmt: skip
    if path is not None:
        _, hf = read_hf_checkpoint(path)
        state = shard_experts(
            shard_tp(hf_to_mcore(hf, shape), shape, tp, rank), shape.num_experts, ep, ep_rank
        )
        load_mcore_state(model, {k: v.to(DTYPES[dtype]) for k, v in state.items()})
    return model, shape


def rope_theta(hf_config: Mapping[str, Any]) -> float:
    """RoPE base of an HF config: `rope_parameters.rope_theta` (transformers 5) or `rope_theta` (4.x)."""
    params = hf_config.get("rope_parameters") or {}
    return float(params.get("rope_theta") or hf_config.get("rope_theta") or 1_000_000.0)
