"""The memory plan's and the floors' shapes of a mixture-of-experts model (Qwen3-MoE): every expert's weights,
gradients and optimizer state counted, the FLOPs of the active parameters. Oracles: a micro Qwen3-MoE's own
parameter count (transformers), and Qwen3-30B-A3B's published sizes (30.5B parameters, 3.3B activated:
huggingface.co/Qwen/Qwen3-30B-A3B)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from helpers_models import MOE_TOP_K, save_micro_moe

from mopd_hpc.engines.memory.estimates import (
    ModelShape,
    activation_bytes_per_position,
    layer_activation_bytes,
    train_state,
)

REPO = Path(__file__).resolve().parents[2]
#: Qwen3-30B-A3B's config.json fields (Qwen3-Coder-30B-A3B-Instruct has the same shape).
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "num_hidden_layers": 48, "hidden_size": 2048, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "vocab_size": 151936, "tie_word_embeddings": False,
}  # fmt: skip


def step_floors():
    spec = importlib.util.spec_from_file_location("step_floors_moe", REPO / "benchmarks" / "step_floors.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_a_micro_moe_counts_every_expert(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(save_micro_moe(tmp_path / "moe"), dtype=torch.float32)
    shape = ModelShape.from_hf_config(model.config.to_dict())
    assert (shape.experts, shape.experts_per_token, shape.moe_layers) == (4, MOE_TOP_K, 2)
    assert shape.params == sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert shape.params - shape.active_params == experts // 2  # 2 of the 4 experts idle per token
    state = train_state(shape, "bfloat16", "torch")
    assert (state.weights, state.gradients, state.optimizer) == (
        2 * shape.params,
        2 * shape.params,
        4 * shape.params,
    )


def test_qwen3_30b_a3b_sizes_and_its_moe_layer_activations() -> None:
    shape = ModelShape.from_hf_config(QWEN3_30B_A3B)
    assert shape.params == pytest.approx(30.5e9, rel=0.01)
    assert shape.active_params == pytest.approx(3.3e9, rel=0.03)
    b = 2
    dense_mlp = 4 * shape.intermediate * b
    moe_mlp = 4 * 8 * 768 * b + 128 * (b + 4)
    assert layer_activation_bytes(shape, "bfloat16", moe=True) - layer_activation_bytes(
        shape, "bfloat16"
    ) == (moe_mlp - dense_mlp)
    extra = activation_bytes_per_position(shape, "bfloat16") - 48 * layer_activation_bytes(
        shape, "bfloat16", moe=True
    )
    assert extra == 4 * 2048 + 4 + b * 2048 + 8 + 2 * 128 * b  # every layer an MoE layer
    # megatron's distributed optimizer over 8 DP ranks still holds every expert's fp32 moments: 12 bytes/param
    state = train_state(shape, "bfloat16", "megatron", tensor_parallel=4, data_parallel=8)
    assert state.optimizer == 12 * (shape.params // 4) // 8


def test_floors_count_the_active_parameters() -> None:
    floors = step_floors()
    moe = floors.ModelShape.from_hf_config(QWEN3_30B_A3B)
    assert moe.active_params == ModelShape.from_hf_config(QWEN3_30B_A3B).active_params
    assert moe.matmul_params == moe.active_params - 151936 * 2048  # the untied input embedding is a lookup
    assert moe.weight_bytes == 2 * moe.params  # the sync moves every expert
    # a decode step of one row reads its 8 experts per layer; of 64 rows, all 128
    assert moe.read_params(1) == moe.matmul_params
    assert moe.read_params(64) == moe.params - 151936 * 2048
    step = floors.StepTokens(
        rows=64, prompt_tokens=64 * 100, response_tokens=64 * 200, new_tokens=200, samples_per_prompt=1
    )
    device = floors.Device(hbm_gbps=4000.0, peak_tflops=800.0)
    train = floors.phase_floors(moe, moe, step, device)["train"]
    assert train == pytest.approx(6 * moe.matmul_params * step.tokens / 800e12)
