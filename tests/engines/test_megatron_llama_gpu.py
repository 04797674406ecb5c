"""megatron-core Llama logits equal transformers' for the same weights, on one GPU (issue 33; the test
`config/capabilities.py` MODEL_FAMILIES names for the megatron engine's Llama).

Two micro Llama checkpoints written by transformers (the megatron engine reads them through the HF ⇄ megatron
converter, `engines/megatron/convert.py`; no q/k norms): `llama31` (Llama 3.1's RoPE frequency scaling,
`rope_type: llama3` factor 8, untied embeddings, 3 layers) and `llama32_tied` (factor 32, tied embeddings as
Llama 3.2 1B/3B, 2 layers); `rope_theta` 500000 and `original_max_position_embeddings` 8192 (the only value megatron-core's llama3 scaling takes) so that the scaling
bends frequencies the 48-token rows reach (engines/megatron/rope.py). One subprocess (megatron's parallel state
is per process): `MegatronScoringEngine.from_pretrained` (TP 1) against `LlamaForCausalLM` /
`TorchScoringEngine` on the same checkpoint, both on cuda:0.

Tolerances as tests/engines/test_megatron_moe_gpu.py (the comparison: tests/helpers_megatron_logits.py) (a dense model has no routing flips, so they hold with margin):
float32 logits and response log-probs within 2e-4 of transformers' (the dense conversion GPU test's,
`test_megatron_convert.py::test_megatron_engines_on_gpu`); bfloat16: megatron-bf16's mean |error| against the
float32 truth ≤ 2 · transformers-bf16's + 2e-3, and the median |megatron − transformers| in bf16 ≤ 0.05 nats.

Skips without CUDA or without megatron-core. Run: `.venv/bin/python -m pytest -q tests/engines/test_megatron_llama_gpu.py`.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from helpers_megatron_logits import run_and_check

_SCRIPT = textwrap.dedent(
    """
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from mopd_hpc.engines.batch import TokenBatch
    from mopd_hpc.engines.megatron.parallel import initialize_parallel

    root = sys.argv[1]
    device = initialize_parallel(rank=0, world_size=1, tensor_parallel=1, device_index=0)
    HF_CLASS = LlamaForCausalLM

    def scaling(factor):
        return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

    CASES = {
        "llama31": dict(num_hidden_layers=3, tie_word_embeddings=False, rope_scaling=scaling(8.0)),
        "llama32_tied": dict(num_hidden_layers=2, tie_word_embeddings=True, rope_scaling=scaling(32.0)),
    }
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 250, (n,), generator=g).tolist() for n in (5, 19, 3, 30)]
    outputs = [torch.randint(1, 250, (n,), generator=g).tolist() for n in (7, 14, 11, 18)]
    batch = TokenBatch.from_samples(prompts, outputs, pad_id=0)
    mask = batch.response_mask.cuda()

    def make_model(fields):
        cfg = LlamaConfig(
            vocab_size=250, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, max_position_embeddings=512, rope_theta=500000.0, rms_norm_eps=1e-5,
            initializer_range=0.05, **fields)
        return LlamaForCausalLM(cfg)
    """
)


@pytest.mark.gpu
def test_megatron_llama_logits_equal_transformers(tmp_path: Path) -> None:
    run_and_check(_SCRIPT, tmp_path, tokens=50)
