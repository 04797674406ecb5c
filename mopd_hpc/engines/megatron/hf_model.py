"""A transformers causal LM built from HF-named weights: the megatron actor's evaluation model.

The megatron actor names its weights as the checkpoint files do (`named_weights`): a mixture-of-experts layer's
experts one by one (`…mlp.experts.e.{gate,up,down}_proj.weight`, engines/expert_names.py), where transformers 5
holds them fused (`…mlp.experts.gate_up_proj` [E, 2·f_e, h], rows per expert cat(gate, up); `…down_proj`
[E, h, f_e]; engines/megatron/convert_moe.py). Each weight is copied straight into its slice of the model's
tensor (an expert's gate into rows [0, f_e) of its gate_up_proj, up into [f_e, 2·f_e), down into its down_proj),
so no fused copy of the experts is stacked beside the model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from mopd_hpc.engines.expert_names import EXPERT_NAME
from mopd_hpc.engines.protocol import EngineError


def _target(params: Mapping[str, torch.Tensor], name: str) -> tuple[str, torch.Tensor | None]:
    """(the model's tensor name, the view of it that `name` fills; None when the model has no such tensor)."""
    if name in params:
        return name, params[name]
    m = EXPERT_NAME.match(name)
    if m is None:
        return name, None
    prefix, e, kind = m.group(1), int(m.group(2)), m.group(3)
    fused = f"{prefix}.{'down_proj' if kind == 'down_proj' else 'gate_up_proj'}"
    tensor = params.get(fused)
    if tensor is None or e >= tensor.shape[0]:
        return name, None
    half = tensor.shape[1] // 2
    view = {"gate_proj": tensor[e, :half], "up_proj": tensor[e, half:], "down_proj": tensor[e]}[kind]
    return fused, view


def hf_model_from_weights(
    hf_config: Mapping[str, Any],
    weights: Iterator[tuple[str, torch.Tensor]],
    device: torch.device,
    dtype: torch.dtype,
) -> torch.nn.Module:
    """`AutoModelForCausalLM.from_config` of an HF config.json dict, on `device` in `dtype`, loaded with
    `weights` (HF names; experts per-expert or fused, module docstring); eval mode, no gradients. A tied
    lm_head (`tie_word_embeddings`) may be absent.

    Raises:
        EngineError: a weight the model lacks (or of another shape), or a model weight missing from `weights`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(hf_config)
    config = AutoConfig.for_model(fields.pop("model_type", "qwen3"), **fields)
    with torch.device(device):  # built in `dtype` (float32 buffers such as RoPE's inv_freq stay float32)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    params = dict(model.named_parameters(remove_duplicate=False))
    filled = dict.fromkeys(params, 0)  # elements written per model tensor
    unexpected = []
    with torch.no_grad():
        for name, tensor in weights:
            key, view = _target(params, name)
            if view is None or view.shape != tensor.shape:
                unexpected.append(name)
                continue
            view.copy_(tensor.detach())
            filled[key] += view.numel()
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = sorted(k for k, n in filled.items() if n < params[k].numel() and k not in tied)
    if unexpected or missing:
        raise EngineError(
            f"the actor's weights do not fit {type(model).__name__}: missing {missing}, "
            f"unexpected {sorted(unexpected)}; expected the HF names of the config's architecture"
        )
    return model.eval().requires_grad_(False)
