"""megatron-core GPTModel for Qwen3, Qwen3-MoE and Llama shapes, with a local layer spec whose core attention
is fused.

A Qwen3-MoE shape's MoE layers are megatron's `MoELayer` (`TopKRouter` over E experts, top k, softmax over
the k selected logits when `norm_topk_prob` (= the k selected probabilities renormalized), else top k of the
softmax over all E; `SequentialMLP` experts, one SwiGLU MLP of size f_e each; the allgather token dispatcher,
which needs no CUDA stream at construction, at expert-parallel size 1; at EP > 1 on GPUs the alltoall one:
engines/megatron/expert_parallel.py). Grouped GEMM (`TEGroupedMLP`) needs
TransformerEngine, which is not installed: `moe_grouped_gemm` stays off. Llama has no q/k norms.

The local spec (`get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")`, algo_awex.md §4.1)
computes attention unfused (baddbmm + softmax + bmm over a [b·H, s, s] buffer): measured on an H200 it
holds teacher scoring to 7 % (0.6B) / 15 % (1.7B) MFU (issue 8). `SDPACoreAttention` keeps the local spec's
parameters and names (it has none of its own) and replaces only the core attention by
`torch.nn.functional.scaled_dot_product_attention` (causal, GQA by `enable_gqa`), which dispatches to
FlashAttention-2 / cuDNN kernels on Hopper. TransformerEngine is not needed.

Shapes in megatron's sequence-first layout: query [s, b, H_p, d], key/value [s, b, G_p, d] (H_p, G_p the
heads and query groups of this TP rank) → context [s, b, H_p·d]. Rows are right-padded (engines/batch.py),
so a causal mask alone is exact for every real position.

megatron-core is imported lazily: importing this module needs it, importing the package does not.
Model construction works on CPU (`use_cpu_initialization=True`); forward needs CUDA (megatron's RoPE).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from mopd_hpc.engines.megatron.convert import Qwen3Shape

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class SDPACoreAttention(DotProductAttention):
    """megatron's local `DotProductAttention` with a fused forward (torch SDPA); same constructor."""

    def forward(  # type: ignore[override]
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
        **unused: Any,
    ) -> torch.Tensor:
        """[s, b, H_p, d], [s, b, G_p, d] ×2 → [s, b, H_p·d]. Causal; `attention_mask` must be None
        (right-padded rows need none); packed sequences and attention bias are not supported."""
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError(
                "SDPACoreAttention supports neither packed sequences nor attention bias"
            )
        if attention_mask is not None:
            raise NotImplementedError("SDPACoreAttention is causal only: pass attention_mask=None")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        p = self.config.attention_dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            dropout_p=p,
            is_causal=True,
            scale=self.softmax_scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)


def layer_spec(
    fused_attention: bool = True, qk_layernorm: bool = True, num_experts: int | None = None
) -> ModuleSpec:
    """The local layer spec of Qwen3 (RMSNorm, q/k layernorm; Llama without them); an MoE layer with
    `num_experts`; its core attention `SDPACoreAttention` when `fused_attention`, else megatron's unfused
    `DotProductAttention` (for comparison)."""
    spec = get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=qk_layernorm, normalization="RMSNorm"
    )
    if not fused_attention:
        return spec
    attn = spec.submodules.self_attention
    attn_sub = dataclasses.replace(attn.submodules, core_attention=SDPACoreAttention)
    layer_sub = dataclasses.replace(
        spec.submodules, self_attention=dataclasses.replace(attn, submodules=attn_sub)
    )
    return dataclasses.replace(spec, submodules=layer_sub)


def block_spec(shape: Qwen3Shape, fused_attention: bool = True) -> ModuleSpec | TransformerBlockSubmodules:
    """One layer spec for every layer of `shape` (dense or all-MoE), else each layer's own (the MoE layers
    of `shape.moe_layers`, the others dense)."""
    dense = layer_spec(fused_attention, shape.qk_layernorm)
    if not shape.moe_layers:
        return dense
    moe = layer_spec(fused_attention, shape.qk_layernorm, shape.num_experts)
    if len(shape.moe_layers) == shape.num_layers:
        return moe
    specs = [moe if n in shape.moe_layers else dense for n in range(shape.num_layers)]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=specs[0].submodules.input_layernorm)


def transformer_config(
    shape: Qwen3Shape,
    dtype: str = "bfloat16",
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    layernorm_epsilon: float = 1e-6,
    cpu_init: bool = False,
    expert_parallel: int = 1,
    token_dispatcher: str = "allgather",
) -> TransformerConfig:
    """The megatron `TransformerConfig` of a Qwen3 / Qwen3-MoE / Llama shape (SwiGLU, RMSNorm, no biases,
    q/k norm but for Llama; MoE: E experts over `expert_parallel` ranks, top k, f_e, softmax after the top k
    when norm_topk_prob, the load-balancing loss off (the job's engines add their own:
    `loss.router_aux_loss_coefficient`), megatron's `token_dispatcher` ("allgather" / "alltoall":
    expert_parallel.token_dispatcher))."""
    torch_dtype = DTYPES[dtype]
    moe = {}
    if shape.moe_layers:
        moe = {
            "num_moe_experts": shape.num_experts,
            "moe_router_topk": shape.moe_router_topk,
            "moe_ffn_hidden_size": shape.moe_ffn_hidden_size,
            "moe_router_pre_softmax": not shape.norm_topk_prob,
            "moe_router_load_balancing_type": "none",
            "moe_token_dispatcher_type": token_dispatcher,
            "expert_model_parallel_size": expert_parallel,
            "moe_grouped_gemm": False,
        }
    return TransformerConfig(
        **moe,
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=shape.qk_layernorm,
        layernorm_epsilon=layernorm_epsilon,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        params_dtype=torch_dtype,
        bf16=torch_dtype == torch.bfloat16,
        fp16=torch_dtype == torch.float16,
        use_cpu_initialization=cpu_init,
    )


def build_gpt_model(
    shape: Qwen3Shape,
    dtype: str = "bfloat16",
    tensor_parallel: int = 1,
    max_sequence_length: int = 40960,
    rope_theta: float = 1_000_000.0,
    fused_attention: bool = True,
    cpu_init: bool = False,
    layernorm_epsilon: float = 1e-6,
    rope_scaling_factor: float | None = None,
    expert_parallel: int = 1,
    token_dispatcher: str = "allgather",
) -> GPTModel:
    """A megatron-core GPTModel of a Qwen3 / Qwen3-MoE / Llama shape (this TP rank's shard); RoPE base
    `rope_theta`, Llama 3's frequency scaling by `rope_scaling_factor` (None: none; engines/megatron/rope.py).
    megatron's parallel_state must be initialized (`initialize_model_parallel`) with the same tensor_parallel
    and `expert_parallel` (this EP rank's experts: E/EP of each MoE layer) first."""
    cfg = transformer_config(
        shape, dtype, tensor_parallel, layernorm_epsilon=layernorm_epsilon, cpu_init=cpu_init,
        expert_parallel=expert_parallel, token_dispatcher=token_dispatcher,
    )  # fmt: skip
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=block_spec(shape, fused_attention),
        vocab_size=shape.padded_vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(rope_theta),
        rope_scaling=rope_scaling_factor is not None,
        rope_scaling_factor=rope_scaling_factor or 8.0,
    )
    # The local spec's norms are torch.nn.RMSNorm built in the default dtype (float32) whatever params_dtype
    # says: cast every parameter to `dtype` (as HF stores them, and as AWEX requires: its plan refuses a
    # dtype that differs between trainer and rollout). Buffers (RoPE inv_freq) keep float32.
    torch_dtype = DTYPES[dtype]
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != torch_dtype:
            param.data = param.data.to(torch_dtype)
    return model


def enable_full_recompute(model: torch.nn.Module) -> None:
    """Activation recompute of every transformer layer of a GPTModel in its train-mode backward: megatron's
    `recompute_granularity='full'`, `recompute_method='uniform'`, `recompute_num_layers=1` (each layer keeps
    only its input, [s, b, h] in the model dtype, and recomputes its forward in the backward). Set on the
    model's `TransformerConfig`, the object every submodule shares; `TransformerBlock.forward` reads it at
    each call, so setting it after construction is the same as building with it (the 'selective' flavour
    is decided at construction and is not offered: with fused SDPA attention it saves little)."""
    config = model.config
    config.recompute_granularity = "full"
    config.recompute_method = "uniform"
    config.recompute_num_layers = 1


def load_mcore_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy a (this rank's) megatron state dict into `model`; only `_extra_state` entries may be missing.

    Raises:
        ValueError: a weight of the model is missing from `state`, or `state` has a key the model lacks.
    """
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("._extra_state")]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"megatron state dict does not fit the model: missing {missing[:3]}, "
            f"unexpected {list(result.unexpected_keys)[:3]}"
        )
