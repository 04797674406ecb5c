"""Grouped-query attention for the one-token decode step without `repeat_kv` (issue 22: rollout near its floor).

Shape legend: B rows, H query heads, K key/value heads, g = H / K (the group), C cache slots, D head dim.

transformers' SDPA path (`integrations/sdpa_attention.py`) repeats each layer's keys and values to H heads
(`repeat_kv`) whenever a mask is given, and its one-token shortcut (`pack_gqa`, in the releases that have it)
is off while torch.compile traces. The compiled decode step of the static decoder passes a mask at every
step, so each of its layers copied the whole K/V cache twice over (the K and V caches at g× their size) and
attention read the copies: measured on an H200 at 256 rows × 1,088 slots (Qwen3-0.6B shape, g = 2), the
copies took 0.42 ms per call (2 calls per layer) and held ~7.7 KB per row and slot in the CUDA-graph pool
(2.3 GiB; `benchmarks/results/hf_decode_grouped.json`'s "before" profile, `gpu_step_roles.json`
64x4x1024@1.7b). With this function the same decode takes 15.0 s instead of 42.5 s (3.5 × its floor).

Here, for a single query position, the g query heads of each key/value head are the g query rows of one
SDPA call over the K heads (the layout `pack_gqa` uses):

    query [B, H, 1, D] -> [B, K, g, D];  SDPA(query, key [B, K, C, D], value, mask [B, 1, 1, C]) -> [B, K, g, D]

which is the same attention (each query head h attends with key/value head h // g, the mapping of
`repeat_kv`), reading each cache slot once. Every other call (prefill, q > 1, a per-head mask, a position
bias, softcap, g = 1) is transformers' own `sdpa_attention_forward`.

A mask narrower than the cache (attention_mask [..., S], S < C) names the slots attended: the first S, the
keys and values read as that prefix (views, no copy) in both branches, so that a decode step reads only
the slots the static decoder has written, rounded up to a span (issue 35; `graph_shape.attention_span`).
transformers' own path would instead cut the mask to the keys' length, which needs S >= C.

`use_grouped_attention(model)` registers the function with transformers' AttentionInterface (and the SDPA mask
builder with its AttentionMaskInterface, for 2D masks) under `NAME` and switches an SDPA model to it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

NAME = "mopd_grouped_sdpa"


def grouped_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B, H, q, D], key/value [B, K, C, D], attention_mask
    bool or additive [B, 1 or H, q, S] or None; returns (output [B, q, H, D] contiguous, None). S < C: only the
    first S slots are attended (module docstring). For q = 1 with H > K and a mask shared by the heads, one
    SDPA call over the K heads (module docstring); else `sdpa_attention_forward` unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None and attention_mask.shape[-1] < key.shape[-2]:
        span = attention_mask.shape[-1]  # the written slots' prefix of a static cache
        key, value = key[:, :, :span], value[:, :, :span]

    groups = getattr(module, "num_key_value_groups", 1)
    b, heads, q_len, dim = query.shape
    shared_mask = attention_mask is None or attention_mask.shape[1] == 1
    plain = kwargs.get("position_bias") is None and kwargs.get("softcap") is None
    if groups == 1 or q_len != 1 or not shared_mask or not plain or key.shape[1] * groups != heads:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
            **kwargs,
        )  # fmt: skip
    grouped = query.reshape(b, key.shape[1], groups, dim)  # head h = k·g + j -> [b, k, j]
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=False
    )  # [B, K, g, D]
    return out.reshape(b, 1, heads, value.shape[-1]), None


def use_grouped_attention(model: Any) -> bool:
    """Switch `model` (a transformers PreTrainedModel whose attention is "sdpa") to `grouped_sdpa_attention`;
    True when switched, False (and unchanged, logged) for another attention or a transformers without the
    interfaces. The registration is process-wide and idempotent."""
    if getattr(model.config, "_attn_implementation", None) not in ("sdpa", NAME):
        return False
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(NAME, grouped_sdpa_attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)
        model.set_attn_implementation(NAME)
    except Exception:  # noqa: BLE001 - an older/newer transformers: keep its SDPA, say so
        log.exception("grouped decode attention unavailable; keeping %s", model.config._attn_implementation)
        return False
    return model.config._attn_implementation == NAME
