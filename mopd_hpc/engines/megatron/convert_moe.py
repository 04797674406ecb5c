"""The MLP of one decoder layer, HF ⇄ megatron-core: a dense SwiGLU MLP or a mixture of experts (Qwen3-MoE).

Name map, `N` the layer, `e` the expert (HF names as the checkpoint files and SGLang spell them; megatron-core's
`MoELayer` with `SequentialMLP` experts and `TopKRouter`, `get_gpt_layer_local_spec(num_experts=E)`):

    model.layers.N.mlp.{gate,up}_proj.weight            → decoder.layers.N.mlp.linear_fc1.weight       [2f, h]
    model.layers.N.mlp.down_proj.weight                 → decoder.layers.N.mlp.linear_fc2.weight       [h, f]
    model.layers.N.mlp.gate.weight             [E, h]   → decoder.layers.N.mlp.router.weight           [E, h]
    model.layers.N.mlp.experts.e.{gate,up}_proj.weight  → decoder.layers.N.mlp.experts.local_experts.e.linear_fc1.weight
                                                [f_e, h] each → [2·f_e, h] = cat(gate, up) (megatron's glu)
    model.layers.N.mlp.experts.e.down_proj.weight       → decoder.layers.N.mlp.experts.local_experts.e.linear_fc2.weight
                                                [h, f_e]

transformers 5 holds the experts of a layer fused in memory (`Qwen3MoeExperts`: `mlp.experts.gate_up_proj`
[E, 2·f_e, h] whose rows per expert are cat(gate, up), `mlp.experts.down_proj` [E, h, f_e]) and writes the
per-expert names above to its checkpoint files; `split_fused_experts` / `fuse_experts` move between the two
(pure reshuffles: views' clones, bitwise).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from mopd_hpc.engines.expert_names import EXPERT_NAME, checkpoint_named

#: take(key, shape) → the tensor of `key` checked against `shape` (it records the key as used).
Take = Callable[[str, tuple[int, ...]], torch.Tensor]


def mlp_hf_to_mcore(take: Take, src: str, dst: str, shape: Any, moe: bool) -> dict[str, torch.Tensor]:
    """One layer's MLP: HF tensors under prefix `src` (`model.layers.N.`) → megatron tensors under `dst`
    (`decoder.layers.N.`); `moe` whether the layer is an MoE layer of `shape` (`Qwen3Shape`)."""
    h = shape.hidden_size
    if not moe:
        f = shape.ffn_hidden_size
        gate, up = take(src + "mlp.gate_proj.weight", (f, h)), take(src + "mlp.up_proj.weight", (f, h))
        return {
            dst + "mlp.linear_fc1.weight": torch.cat([gate, up], dim=0),
            dst + "mlp.linear_fc2.weight": take(src + "mlp.down_proj.weight", (h, f)).clone(),
        }
    fe = shape.moe_ffn_hidden_size
    out = {dst + "mlp.router.weight": take(src + "mlp.gate.weight", (shape.num_experts, h)).clone()}
    for e in range(shape.num_experts):
        hf, mc = f"{src}mlp.experts.{e}.", f"{dst}mlp.experts.local_experts.{e}."
        gate, up = take(hf + "gate_proj.weight", (fe, h)), take(hf + "up_proj.weight", (fe, h))
        out[mc + "linear_fc1.weight"] = torch.cat([gate, up], dim=0)
        out[mc + "linear_fc2.weight"] = take(hf + "down_proj.weight", (h, fe)).clone()
    return out


def mlp_mcore_to_hf(take: Take, src: str, dst: str, shape: Any, moe: bool) -> dict[str, torch.Tensor]:
    """Inverse of `mlp_hf_to_mcore`: megatron tensors under `src` → HF tensors (checkpoint names) under `dst`."""
    h = shape.hidden_size
    if not moe:
        f = shape.ffn_hidden_size
        gate, up = take(src + "mlp.linear_fc1.weight", (2 * f, h)).split([f, f], dim=0)
        return {
            dst + "mlp.gate_proj.weight": gate.clone(),
            dst + "mlp.up_proj.weight": up.clone(),
            dst + "mlp.down_proj.weight": take(src + "mlp.linear_fc2.weight", (h, f)).clone(),
        }
    fe = shape.moe_ffn_hidden_size
    out = {dst + "mlp.gate.weight": take(src + "mlp.router.weight", (shape.num_experts, h)).clone()}
    for e in range(shape.num_experts):
        mc, hf = f"{src}mlp.experts.local_experts.{e}.", f"{dst}mlp.experts.{e}."
        gate, up = take(mc + "linear_fc1.weight", (2 * fe, h)).split([fe, fe], dim=0)
        out[hf + "gate_proj.weight"], out[hf + "up_proj.weight"] = gate.clone(), up.clone()
        out[hf + "down_proj.weight"] = take(mc + "linear_fc2.weight", (h, fe)).clone()
    return out


def split_fused_experts(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's in-memory expert tensors (`…mlp.experts.gate_up_proj` [E, 2·f_e, h],
    `…mlp.experts.down_proj` [E, h, f_e]) → the per-expert checkpoint names (clones); other keys pass through."""
    return {name: t if name in sd else t.clone() for name, t in checkpoint_named(sd.items())}


def fuse_experts(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of `split_fused_experts`: the per-expert checkpoint names → transformers 5's fused tensors.

    Raises:
        ValueError: a layer's experts are not numbered 0..E−1 with all three projections each.
    """
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for key, t in sd.items():
        m = EXPERT_NAME.match(key)
        if m is None:
            out[key] = t
            continue
        prefix, e, kind = m.groups()
        groups.setdefault(prefix, {}).setdefault(int(e), {})[kind] = t
    for prefix, experts in groups.items():
        n = len(experts)
        if sorted(experts) != list(range(n)) or any(len(p) != 3 for p in experts.values()):
            raise ValueError(
                f"{prefix}: experts {sorted(experts)} are not 0..{n - 1} with gate, up and down each"
            )
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]], dim=0) for e in range(n)]
        )
        out[f"{prefix}.down_proj"] = torch.stack([experts[e]["down_proj"] for e in range(n)])
    return out
