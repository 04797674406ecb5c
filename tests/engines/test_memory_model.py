"""The engines' memory estimate (`engines/memory/estimates.py`) against what torch really keeps: parameter counts
of transformers models, and the activation bytes autograd saves in a transformers Qwen3 forward on CPU
(saved-tensor hooks, each storage counted once, parameters excluded), which the formula gives exactly.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from mopd_hpc.engines.memory.estimates import (
    MemoryModelError,
    ModelShape,
    activation_bytes_per_position,
    default_micro_batch_tokens,
    loss_bytes_per_position,
    micro_batch_bytes,
    train_state,
)

#: (hidden, heads, kv heads, head dim, MLP width, layers, tied): H·d ≠ h in the first two.
SHAPES = [(128, 4, 2, 64, 384, 2, True), (96, 6, 2, 32, 200, 1, False), (64, 4, 4, 16, 128, 3, True)]


def qwen3(h: int, heads: int, kv: int, d: int, f: int, layers: int, tied: bool) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=300, hidden_size=h, intermediate_size=f, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=d, tie_word_embeddings=tied, attn_implementation="sdpa",
    )  # fmt: skip
    return Qwen3ForCausalLM(cfg)


def saved_bytes(model: torch.nn.Module, length: int, checkpointing: bool = False) -> int:
    """Bytes autograd keeps for the backward of the decoder's forward over one row of `length` tokens."""
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        key = t.untyped_storage().data_ptr()
        if key not in seen and key not in params:
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, 300, (1, length))
    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.get_decoder()(input_ids=ids, use_cache=False)
    return total


@pytest.mark.parametrize("dims", SHAPES, ids=lambda d: "x".join(map(str, d[:5])))
def test_params_and_activations_are_what_torch_keeps(dims) -> None:
    model = qwen3(*dims)
    shape = ModelShape.from_hf_config(model.config.to_dict())
    assert shape.params == sum(p.numel() for p in model.parameters())
    for dtype in ("float32", "bfloat16"):
        cast = model.to(getattr(torch, dtype))
        for length in (40, 200):
            assert saved_bytes(cast, length) == activation_bytes_per_position(shape, dtype) * length, (
                dtype, length,
            )  # fmt: skip


def test_recompute_keeps_the_layer_inputs() -> None:
    model = qwen3(*SHAPES[0])
    shape = ModelShape.from_hf_config(model.config.to_dict())
    kept = saved_bytes(model, 100, checkpointing=True)
    full = activation_bytes_per_position(shape, "float32") * 100
    estimate = activation_bytes_per_position(shape, "float32", checkpointing=True) * 100
    # The forward keeps less than a third; the estimate (which adds one layer's recompute, live only in the
    # backward) bounds what the forward keeps.
    assert kept * 3 < full and kept <= estimate < full


def test_state_loss_and_default_budget_arithmetic() -> None:
    shape = ModelShape(28, 1024, 16, 8, 128, 3072, 151936, True)  # Qwen3-0.6B
    assert round(shape.params / 1e6, 1) == 596.0
    p = shape.params
    assert train_state(shape, "bfloat16", "torch").total == 8 * p
    meg = train_state(shape, "bfloat16", "megatron", data_parallel=2)
    assert (meg.weights, meg.gradients, meg.optimizer) == (2 * p, 4 * p, 6 * p)
    assert train_state(shape, "float32", "megatron").optimizer == 8 * p  # no separate fp32 main copy
    assert loss_bytes_per_position(shape, "bfloat16", "torch") == 4 * 151936
    assert loss_bytes_per_position(shape, "bfloat16", "megatron") == 8 * 151936
    one = micro_batch_bytes(shape, "bfloat16", "megatron", 1, 1)
    assert micro_batch_bytes(shape, "bfloat16", "megatron", 1000, 0) == pytest.approx(1000 * one, rel=1e-6)
    budget = default_micro_batch_tokens(shape, "bfloat16", "megatron", 100 * 2**30)
    assert budget == int(0.5 * 100 * 2**30) // one
    assert micro_batch_bytes(shape, "bfloat16", "megatron", budget, budget) <= 50 * 2**30
    assert default_micro_batch_tokens(shape, "bfloat16", "megatron", -5) == 1
    with pytest.raises(
        MemoryModelError, match="config.json num_attention_heads=None: expected a positive int"
    ):
        ModelShape.from_hf_config({"hidden_size": 8})
    with pytest.raises(MemoryModelError, match="engine 'jax'"):
        train_state(shape, "bfloat16", "jax")
