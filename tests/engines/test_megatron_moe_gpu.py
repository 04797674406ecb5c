"""megatron-core MoE logits equal transformers' for the same weights, on one GPU (issue 33, expert_parallel 1).

Two micro Qwen3-MoE checkpoints written by transformers (the megatron engine reads them through the HF ⇄
megatron converter, `engines/megatron/convert.py`): `mixed` (3 layers, layer 1 dense by `mlp_only_layers`,
8 experts of f_e 64, top 2, `norm_topk_prob` true: megatron's top k then softmax over the k) and `all_moe`
(every layer MoE, `norm_topk_prob` false: megatron's softmax over all E then top k). The routers are drawn
N(0, 1) (transformers starts them at 0: every token would tie) so that routing depends on the token.
One subprocess (megatron's parallel state is per process): `MegatronScoringEngine.from_pretrained`
(TP 1, EP 1: `initialize_model_parallel` with its default expert_model_parallel_size 1) against
`Qwen3MoeForCausalLM` / `TorchScoringEngine` on the same checkpoint, both on cuda:0.

Tolerances:
- float32: logits at every response position (the V real columns of megatron's padded V') and the response
  log-probs within 2e-4 of transformers': the tolerance of the dense conversion GPU test
  (`test_megatron_convert.py::test_megatron_engines_on_gpu`, float32; the megatron scoring tests meet it);
- bfloat16 (the production dtype; no dense test fixes a bf16 tolerance): megatron-bf16 is as close to the
  float32 truth as transformers-bf16 is. Per response token e = |log p_bf16 − log p_fp32(transformers)|;
  mean e of megatron ≤ 2 · mean e of transformers + 2e-3, and the median |megatron − transformers| in bf16
  ≤ 0.05 nats. Why not a fixed bound: bf16 keeps 8 mantissa bits, the two stacks round in different places
  (fused vs separate gate/up GEMMs, the router's softmax over k or over E), and a token whose k-th and
  (k+1)-th router logits are within a bf16 rounding of each other is routed to a different expert by one
  of them, which moves that token's log-prob by far more than rounding: a mean over the tokens, held
  against transformers' own bf16 error, is robust to a few such flips; a max is not.

Skips without CUDA or without megatron-core. Runtime on an H100: ~30 s (two imports of megatron, 4 tiny models).
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
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from mopd_hpc.engines.batch import TokenBatch
    from mopd_hpc.engines.megatron.parallel import initialize_parallel

    root = sys.argv[1]
    device = initialize_parallel(rank=0, world_size=1, tensor_parallel=1, device_index=0)
    HF_CLASS = Qwen3MoeForCausalLM
    CASES = {
        "mixed": dict(num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True),
        "all_moe": dict(num_hidden_layers=2, mlp_only_layers=[], norm_topk_prob=False),
    }
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 250, (n,), generator=g).tolist() for n in (5, 9, 3, 12)]
    outputs = [torch.randint(1, 250, (n,), generator=g).tolist() for n in (7, 4, 11, 9)]
    batch = TokenBatch.from_samples(prompts, outputs, pad_id=0)
    mask = batch.response_mask.cuda()

    def make_model(fields):
        cfg = Qwen3MoeConfig(
            vocab_size=250, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_experts=8,
            num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.05, **fields)
        model = Qwen3MoeForCausalLM(cfg)
        with torch.no_grad():
            for layer in model.model.layers:
                if hasattr(layer.mlp, "gate"):
                    layer.mlp.gate.weight.normal_(0.0, 1.0)
        return model
    """
)


@pytest.mark.gpu
def test_megatron_moe_logits_equal_transformers(tmp_path: Path) -> None:
    run_and_check(_SCRIPT, tmp_path, tokens=31)
