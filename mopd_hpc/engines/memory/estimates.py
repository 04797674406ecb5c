"""GPU memory of the engines from model shapes (config.json) and step sizes: pure arithmetic, no torch.

Used by the `--dry-run` memory plan (`plan/memory_plan.py`) and by the train engines' default micro-batch
budget on CUDA (`default_micro_batch_tokens`). Estimates, in bytes; b = bytes per element of the model dtype.

Train state per actor rank (TP size t, DP size n; P parameters, `ModelShape.params`):
- weights P·b/t;
- gradients: torch P·b/t (the parameters' .grad); megatron P·4/t (DDP's fp32 main-grad buffer,
  grad_reduce_in_fp32);
- optimizer: torch AdamW 2·P·b/t (exp_avg, exp_avg_sq in the parameter dtype); megatron's distributed
  optimizer (4·[b < 4] + 8)·P/(t·n) (fp32 main parameters for a 16-bit model, Adam's two fp32 moments,
  sharded over DP).
At expert-parallel size e (megatron, engines/megatron/expert_parallel.py) a rank holds E/e experts of each MoE
layer: the weights and gradients count P_rank = P − P_experts·(1 − 1/e) (`ModelShape.expert_params`) in
place of P; the optimizer state stays (4·[b < 4] + 8)·P/(t·n): the experts' is sharded over the
expert-data-parallel group of n/e ranks, (P_experts/(t·e))/(n/e) = P_experts/(t·n).

Activations kept for the backward, per position and decoder layer (no recompute), counted from what autograd
saves in a transformers Qwen3 layer with fused (SDPA / flash) attention, whose [s, s] scores are never stored
(the accounting of Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
§4, for this layer):
    b·(4h + 3(H+G)d + 4f) + 4·(2h + 2 + (H+G)d + 2H + G)
(h hidden, H heads, G KV heads, d head dim, f MLP width): each of the two RMSNorms keeps its input in float32,
its reciprocal RMS, its normalized value and its output in b; the q/k norms their float32 inputs, reciprocal
RMS and normalized values; attention its q, k (after RoPE), v, output and float32 log-sum-exp; the SwiGLU MLP
its gate, up, silu(gate) and product (4f). Per position besides the layers: the final norm (4h + 4 + b·h),
the token id (8) and RoPE's cos/sin (2·d·b, one sequence). On CPU this is exactly what autograd keeps
(tests/engines/test_memory_model.py measures it with saved-tensor hooks); megatron's local layer spec is estimated
with the same count. Full recompute (`activation_checkpointing`) keeps each layer's input h·b and recomputes
one layer at a time: layers·h·b + one layer's activations.

The loss (per position it is computed at): the LM head's logits V·b and their gradient V·b (torch: response
positions only, `ResponseLogits`); megatron's labels path runs over every position: logits V·b, the
vocab-parallel cross entropy's float32 softmax 4·V/t, and the logits' gradient V·b — 6·V for bf16 at t = 1,
0.9 MB per position at V = 151,936, what made the 64 × 4 × 256 step of issue 21 run out of memory.

A mixture-of-experts shape (Qwen3-MoE: E experts of width f_e, k routed per token, in its MoE layers) holds
every expert: P counts all E experts' weights and the routers [E, h] (so do the gradients and the optimizer
state, at expert-parallel size 1); an MoE layer's activations per position replace the SwiGLU's 4f by what its
k routed experts keep, 4·k·f_e, plus the router's logits (b) and its float32 softmax (4), E each
(`ModelShape.active_params` is what one token computes with: k experts of each MoE layer).

These are estimates of the largest terms (not the allocator's fragmentation, CUDA context, or kernels'
workspaces); `ACTIVATION_MARGIN[engine]` multiplies the activations and loss terms to cover them. Megatron's
is calibrated on an H200 (benchmarks/results/gpu_memory.json, configs/local_gpu_colocated.yaml, random
Qwen3-0.6B shape, bf16, the derived budget): the actor's peak reserved memory in the train phase less its
state was 0.88 of this count at 64 × 4 × 256 (17,280 positions a micro-batch) and 0.79 at 64 × 4 × 1024 (19,584
positions), fragmentation included (megatron's local layers save less than transformers' — its SwiGLU and
norms), so megatron's margin is 1.0: the count itself, above both measurements, and a plan within 1.25× of
them; torch's keeps 1.2 (not measured on a GPU yet).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DTYPE_BYTES: Mapping[str, int] = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
#: Multiplier on activation and loss bytes for what the count leaves out (temporaries, fragmentation), per
#: engine (module docstring: megatron's measured on an H200).
ACTIVATION_MARGIN: Mapping[str, float] = {"torch": 1.2, "megatron": 1.0}
#: Share of the free GPU memory the default micro-batch budget may fill with activations.
FREE_FRACTION = 0.5


class MemoryModelError(ValueError):
    """A model config without a key the estimate needs, or an unknown dtype or engine."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The sizes of a decoder (Qwen3/Llama-like, or Qwen3-MoE) that memory depends on. Build with
    `from_hf_config`. experts (E, 0 = dense), expert_intermediate (f_e), experts_per_token (k), moe_layers
    (how many layers are MoE layers; the others are dense of width `intermediate`)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    experts: int = 0
    expert_intermediate: int = 0
    experts_per_token: int = 0
    moe_layers: int = 0

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """From a config.json dict (`num_hidden_layers`, `hidden_size`, `num_attention_heads`,
        `num_key_value_heads` (default: heads), `head_dim` (default hidden/heads), `intermediate_size`,
        `vocab_size`, `tie_word_embeddings` (default False); a Qwen3-MoE's `num_experts` (transformers 5
        writes `num_local_experts`),
        `moe_intermediate_size`, `num_experts_per_tok`, and its MoE layers by `decoder_sparse_step` and
        `mlp_only_layers` as transformers' `Qwen3MoeDecoderLayer` picks them).

        Raises:
            MemoryModelError: a required key is missing or not a positive int.
        """

        def need(key: str) -> int:
            value = config.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MemoryModelError(f"config.json {key}={value!r}: expected a positive int")
            return value

        heads = need("num_attention_heads")
        hidden = need("hidden_size")
        layers = need("num_hidden_layers")
        moe: dict[str, int] = {}
        experts = config.get("num_experts") or config.get(
            "num_local_experts"
        )  # transformers 5 writes the latter
        if experts:
            step, dense = (
                int(config.get("decoder_sparse_step") or 1),
                set(config.get("mlp_only_layers") or ()),
            )
            moe = {
                "experts": int(experts),
                "expert_intermediate": need("moe_intermediate_size"),
                "experts_per_token": need("num_experts_per_tok"),
                "moe_layers": sum(1 for n in range(layers) if n not in dense and (n + 1) % step == 0),
            }
        return cls(
            **moe,
            layers=layers,
            hidden=hidden,
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate=need("intermediate_size"),
            vocab=need("vocab_size"),
            tied=bool(config.get("tie_word_embeddings", False)),
        )

    @property
    def params(self) -> int:
        """Parameters: embeddings (+ an untied LM head), per layer q/k/v/o, q/k norms, two norms and the
        SwiGLU MLP (an MoE layer: its router and all E experts), the final norm."""
        return self._params(self.experts)

    @property
    def active_params(self) -> int:
        """The parameters one token computes with: `params` with k of the E experts of each MoE layer (the
        router whole); `params` for a dense shape."""
        return self._params(self.experts_per_token)

    @property
    def expert_params(self) -> int:
        """The routed experts' parameters (3·h·f_e each, E in each MoE layer; routers not counted): what
        expert parallelism splits over its ranks."""
        return self.moe_layers * self.experts * 3 * self.hidden * self.expert_intermediate

    def _params(self, experts: int) -> int:
        h, d = self.hidden, self.head_dim
        attn = h * self.heads * d * 2 + h * self.kv_heads * d * 2 + 2 * d
        dense = attn + 3 * h * self.intermediate + 2 * h
        moe = attn + experts * 3 * h * self.expert_intermediate + self.experts * h + 2 * h
        layers = (self.layers - self.moe_layers) * dense + self.moe_layers * moe
        return self.vocab * h * (1 if self.tied else 2) + layers + h


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name; MemoryModelError for an unknown one."""
    if dtype not in DTYPE_BYTES:
        raise MemoryModelError(f"dtype {dtype!r}: expected one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def layer_activation_bytes(shape: ModelShape, dtype: str, moe: bool = False) -> int:
    """Bytes one decoder layer keeps per position for its backward (module docstring's formula); `moe`: an
    MoE layer of the shape (its k routed experts' 4·k·f_e and the router's E·(b + 4) for the SwiGLU's 4f)."""
    b = dtype_bytes(dtype)
    h, d, q, g, f = shape.hidden, shape.head_dim, shape.heads, shape.kv_heads, shape.intermediate
    mlp = 4 * f * b
    if moe:
        mlp = 4 * shape.experts_per_token * shape.expert_intermediate * b + shape.experts * (b + 4)
    return b * (4 * h + 3 * (q + g) * d) + mlp + 4 * (2 * h + 2 + (q + g) * d + 2 * q + g)


def layers_activation_bytes(shape: ModelShape, dtype: str) -> int:
    """Bytes every decoder layer keeps per position: the dense layers' and the MoE layers'."""
    dense = (shape.layers - shape.moe_layers) * layer_activation_bytes(shape, dtype)
    return dense + shape.moe_layers * layer_activation_bytes(shape, dtype, moe=True)


def activation_bytes_per_position(shape: ModelShape, dtype: str, checkpointing: bool = False) -> int:
    """Bytes the decoder keeps per position for its backward: every layer (with full recompute: the layers'
    inputs plus one layer's activations), the final norm, the token id and RoPE's cos/sin (module
    docstring)."""
    b, h = dtype_bytes(dtype), shape.hidden
    extra = 4 * h + 4 + b * h + 8 + 2 * shape.head_dim * b
    if checkpointing:  # one layer recomputed at a time: the largest
        layer = layer_activation_bytes(shape, dtype)
        if shape.moe_layers:
            layer = max(layer, layer_activation_bytes(shape, dtype, moe=True))
        return shape.layers * h * b + layer + extra
    return layers_activation_bytes(shape, dtype) + extra


def loss_bytes_per_position(shape: ModelShape, dtype: str, engine: str, tensor_parallel: int = 1) -> int:
    """Bytes of the LM head and loss per position the loss runs over (torch: response positions; megatron:
    every position, module docstring).

    Raises:
        MemoryModelError: an engine other than 'torch' or 'megatron'.
    """
    b = dtype_bytes(dtype)
    if engine == "torch":
        return 2 * shape.vocab * b
    if engine == "megatron":
        return (2 * shape.vocab * b + 4 * shape.vocab) // tensor_parallel
    raise MemoryModelError(f"engine {engine!r}: expected 'torch' or 'megatron'")


@dataclass(frozen=True, slots=True)
class TrainState:
    """Bytes of one actor rank's resident train state (module docstring)."""

    weights: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer


def train_state(
    shape: ModelShape,
    dtype: str,
    engine: str,
    tensor_parallel: int = 1,
    data_parallel: int = 1,
    expert_parallel: int = 1,
) -> TrainState:
    """Weights, gradients and optimizer state of one actor rank (module docstring; `expert_parallel` e: the
    rank's E/e experts a MoE layer, megatron only).

    Raises:
        MemoryModelError: an unknown dtype or engine.
    """
    b, p = dtype_bytes(dtype), shape.params // tensor_parallel
    if engine == "torch":
        return TrainState(p * b, p * b, 2 * p * b)
    if engine == "megatron":
        main = 4 if b < 4 else 0
        held = (
            shape.params - shape.expert_params + shape.expert_params // expert_parallel
        ) // tensor_parallel
        return TrainState(held * b, held * 4, (main + 8) * p // data_parallel)
    raise MemoryModelError(f"engine {engine!r}: expected 'torch' or 'megatron'")


def micro_batch_bytes(
    shape: ModelShape,
    dtype: str,
    engine: str,
    positions: int,
    loss_positions: int,
    checkpointing: bool = False,
    tensor_parallel: int = 1,
) -> int:
    """Activation and loss bytes of one micro-batch of `positions` positions of which `loss_positions` are
    response positions (megatron's loss runs over all of them), times the engine's ACTIVATION_MARGIN."""
    act = activation_bytes_per_position(shape, dtype, checkpointing) * positions // tensor_parallel
    at = positions if engine == "megatron" else loss_positions
    loss = loss_bytes_per_position(shape, dtype, engine, tensor_parallel) * at
    return int(ACTIVATION_MARGIN[engine] * (act + loss))


def default_micro_batch_tokens(
    shape: ModelShape,
    dtype: str,
    engine: str,
    free_bytes: int,
    checkpointing: bool = False,
    tensor_parallel: int = 1,
) -> int:
    """The micro-batch budget (positions) a CUDA train engine uses when `micro_batch_tokens` is null:
    FREE_FRACTION of `free_bytes` (what the GPU has free for this step, after the state it will still
    allocate) over `micro_batch_bytes` of one position, every position counted as a loss position; at least
    1 (a row longer than the budget runs alone)."""
    per_position = micro_batch_bytes(shape, dtype, engine, 1, 1, checkpointing, tensor_parallel)
    return max(1, int(FREE_FRACTION * max(0, free_bytes)) // max(1, per_position))
