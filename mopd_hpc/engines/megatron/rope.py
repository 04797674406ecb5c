"""The RoPE scaling of an HF config.json that megatron-core's GPTModel can reproduce (issue 33, Llama 3.x).

Llama 3.1 / 3.2 / 3.3 checkpoints scale their rotary frequencies (`rope_scaling` in a 4.x config.json,
`rope_parameters` in transformers 5): rope_type "llama3" with `factor` (8 for 3.1/3.3, 32 for 3.2),
`low_freq_factor` 1, `high_freq_factor` 4, `original_max_position_embeddings` 8192 (transformers'
`_compute_llama3_parameters`). megatron-core's `RotaryEmbedding._apply_scaling` computes the same with the
factor a parameter (GPTModel's `rope_scaling_factor`) and the other three fixed at those values. The scaling
changes every frequency below 2π/8192·4, so it matters at every position, not only past the original context.

`megatron_rope_scaling` returns GPTModel's factor (None: no scaling) and refuses what megatron would silently
compute differently. No torch import: `--check` reads it (launch/rope_check.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class RopeScalingError(ValueError):
    """A config.json's RoPE scaling megatron-core does not compute; the message names the value and the way out."""


#: megatron-core's fixed llama3 parameters (`RotaryEmbedding._apply_scaling` defaults).
MEGATRON_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def megatron_rope_scaling(hf_config: Mapping[str, Any]) -> float | None:
    """GPTModel's `rope_scaling_factor` for the RoPE scaling of `hf_config` (config.json as a dict); None when
    it has none (rope_type "default" or absent).

    Raises:
        RopeScalingError: a rope_type other than "default" / "llama3", or llama3 parameters megatron fixes to other
            values (`MEGATRON_LLAMA3`), named with the value.
    """
    # transformers 5 writes `rope_parameters`, 4.x `rope_scaling`: a config with both is a 4.x one read by 5
    params = dict(hf_config.get("rope_parameters") or {}) | dict(hf_config.get("rope_scaling") or {})
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return None
    if kind != "llama3":
        raise RopeScalingError(
            f"rope_type={kind!r}: the megatron engine applies no RoPE scaling but llama3's (megatron-core's "
            "RotaryEmbedding); expected 'default' or 'llama3', or engine: torch"
        )
    for name, fixed in MEGATRON_LLAMA3.items():
        if name in params and float(params[name]) != fixed:
            raise RopeScalingError(
                f"rope {name}={params[name]}: megatron-core's llama3 scaling fixes it to {fixed}; "
                "expected that value, or engine: torch"
            )
    return float(params.get("factor", 8.0))
