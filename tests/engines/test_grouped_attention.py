"""The grouped one-token attention (`engines/rollout/grouped_attention.py`) against transformers' own SDPA path.

Oracles: the attention written out with K/V repeated to every query head, and transformers'
`sdpa_attention_forward` on the same tensors, in float64 on CPU (≤ 1e-12). The engine's switch to it and
its decoding against plain SDPA are in test_hf_decoder.py (test_static_engine_switches_sdpa_to_grouped_...).
On CUDA (H200, transformers 5.17) the compiled decode step with it is checked by test_hf_decoder.py's and
test_rollout_server.py's CUDA tests against a direct forward pass.
"""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from mopd_hpc.engines.rollout.grouped_attention import grouped_sdpa_attention

B, H, KV, C, D = 3, 8, 2, 11, 16


class Attn(torch.nn.Module):
    """What transformers' attention functions read from the module: the group size."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def tensors(q_len: int, kv: int = KV, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # query as the model makes it: [B, q, H, D] transposed to [B, H, q, D] (not contiguous)
    query = torch.randn(B, q_len, H, D, generator=g, dtype=torch.float64).transpose(1, 2)
    key = torch.randn(B, kv, C, D, generator=g, dtype=torch.float64)
    value = torch.randn(B, kv, C, D, generator=g, dtype=torch.float64)
    mask = torch.rand(B, 1, q_len, C, generator=g) < 0.7
    mask[..., 0] = True  # no empty softmax row
    return query, key, value, mask


def reference(query, key, value, mask):
    """softmax(q·kᵀ/√D + mask)·v with query head h on key/value head h // g (`repeat_kv`'s map), written out:
    [B, q, H, D]."""
    groups = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = query @ k.transpose(-1, -2) * D**-0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("masked", [True, False])
def test_one_token_step_equals_transformers_sdpa(masked):
    query, key, value, mask = tensors(q_len=1)
    mask = mask if masked else None
    module = Attn(H // KV)
    got, _ = grouped_sdpa_attention(module, query, key, value, mask, scaling=D**-0.5)
    assert got.shape == (B, 1, H, D)
    assert (got - reference(query, key, value, mask)).abs().max() <= 1e-12
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=D**-0.5)
    assert (got - want).abs().max() <= 1e-12


@pytest.mark.parametrize(
    ("q_len", "mask_heads", "kv"),
    [(4, 1, KV), (1, H, KV), (1, 1, H)],
    ids=["prefill", "per-head-mask", "no-groups"],
)
def test_other_calls_are_transformers_sdpa_exactly(q_len, mask_heads, kv):
    query, key, value, mask = tensors(q_len=q_len, kv=kv)
    mask = mask.expand(B, mask_heads, q_len, C)
    module = Attn(H // kv)
    got, _ = grouped_sdpa_attention(module, query, key, value, mask, scaling=D**-0.5)
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=D**-0.5)
    assert torch.equal(got, want)


@pytest.mark.parametrize("q_len", [1, 4], ids=["decode", "prefill"])
def test_a_mask_narrower_than_the_cache_attends_its_prefix(q_len):
    """A mask of S < C slots (the static decoder's span of written slots): the attention over the first S slots
    only, as if the cache had S slots, and as the full-width mask with the slots beyond S masked out."""
    query, key, value, mask = tensors(q_len=q_len)
    span = 7
    module = Attn(H // KV)
    got, _ = grouped_sdpa_attention(module, query, key, value, mask[..., :span], scaling=D**-0.5)
    prefix = reference(query, key[:, :, :span], value[:, :, :span], mask[..., :span])
    assert (got - prefix).abs().max() <= 1e-12
    wide = mask.clone()
    wide[..., span:] = False
    full, _ = grouped_sdpa_attention(module, query, key, value, wide, scaling=D**-0.5)
    assert (got - full).abs().max() <= 1e-12
