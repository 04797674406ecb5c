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
(tests/test_memory_model.py measures it with saved-tensor hooks); megatron's local layer spec is estimated
with the same count. Full recompute (`activation_checkpointing`) keeps each layer's input h·b and recomputes
one layer at a time: layers·h·b + one layer's activations.

The loss (per position it is computed at): the LM head's logits V·b and their gradient V·b (torch: response
positions only, `ResponseLogits`); megatron's labels path runs over every position: logits V·b, the
vocab-parallel cross entropy's float32 softmax 4·V/t, and the logits' gradient V·b — 6·V for bf16 at t = 1,
0.9 MB per position at V = 151,936, what made the 64 × 4 × 256 step of issue 21 run out of memory.

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
    """The sizes of a dense decoder (Qwen3/Llama-like) that memory depends on. Build with `from_hf_config`."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """From a config.json dict (`num_hidden_layers`, `hidden_size`, `num_attention_heads`,
        `num_key_value_heads` (default: heads), `head_dim` (default hidden/heads), `intermediate_size`,
        `vocab_size`, `tie_word_embeddings` (default False)).

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
        return cls(
            layers=need("num_hidden_layers"),
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
        SwiGLU MLP, the final norm."""
        h, d = self.hidden, self.head_dim
        attn = h * self.heads * d * 2 + h * self.kv_heads * d * 2 + 2 * d
        layer = attn + 3 * h * self.intermediate + 2 * h
        return self.vocab * h * (1 if self.tied else 2) + self.layers * layer + h


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name; MemoryModelError for an unknown one."""
    if dtype not in DTYPE_BYTES:
        raise MemoryModelError(f"dtype {dtype!r}: expected one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def layer_activation_bytes(shape: ModelShape, dtype: str) -> int:
    """Bytes one decoder layer keeps per position for its backward (module docstring's formula)."""
    b = dtype_bytes(dtype)
    h, d, q, g, f = shape.hidden, shape.head_dim, shape.heads, shape.kv_heads, shape.intermediate
    return b * (4 * h + 3 * (q + g) * d + 4 * f) + 4 * (2 * h + 2 + (q + g) * d + 2 * q + g)


def activation_bytes_per_position(shape: ModelShape, dtype: str, checkpointing: bool = False) -> int:
    """Bytes the decoder keeps per position for its backward: every layer (with full recompute: the layers'
    inputs plus one layer's activations), the final norm, the token id and RoPE's cos/sin (module
    docstring)."""
    b, h = dtype_bytes(dtype), shape.hidden
    extra = 4 * h + 4 + b * h + 8 + 2 * shape.head_dim * b
    layer = layer_activation_bytes(shape, dtype)
    if checkpointing:
        return shape.layers * h * b + layer + extra
    return shape.layers * layer + extra


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
    shape: ModelShape, dtype: str, engine: str, tensor_parallel: int = 1, data_parallel: int = 1
) -> TrainState:
    """Weights, gradients and optimizer state of one actor rank (module docstring).

    Raises:
        MemoryModelError: an unknown dtype or engine.
    """
    b, p = dtype_bytes(dtype), shape.params // tensor_parallel
    if engine == "torch":
        return TrainState(p * b, p * b, 2 * p * b)
    if engine == "megatron":
        main = 4 if b < 4 else 0
        return TrainState(p * b, p * 4, (main + 8) * p // data_parallel)
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
