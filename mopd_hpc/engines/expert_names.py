"""A mixture-of-experts model's expert weights under their two spellings, as views of one another.

Checkpoint files, megatron's export (`engines/megatron/convert_moe.py`) and SGLang's loader name each expert's
projections one by one: `model.layers.N.mlp.experts.e.{gate,up,down}_proj.weight` ([f_e, h], [f_e, h], [h, f_e]).
transformers 5 holds a layer's experts fused in memory (`Qwen3MoeExperts`): `…mlp.experts.gate_up_proj`
[E, 2·f_e, h] whose rows per expert are cat(gate, up), and `…mlp.experts.down_proj` [E, h, f_e].
`expert_views` gives, for the per-expert names a model of the fused layout does not hold, the slices of its
fused parameters they are: copying a tensor into such a view writes the expert's rows of the fused tensor
(bitwise), so a weight sync that speaks checkpoint names loads into a transformers 5 model unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

#: A per-expert checkpoint name: (the layer's `…mlp.experts` prefix, expert e, gate_proj / up_proj / down_proj).
EXPERT_NAME = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
#: transformers 5's fused expert tensor of a layer: (the `…mlp.experts` prefix, gate_up_proj / down_proj).
FUSED_NAME = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def expert_views(state: Mapping[str, torch.Tensor], names: Iterable[str]) -> dict[str, torch.Tensor]:
    """name → the view of a fused expert tensor of `state` (a model's `state_dict(keep_vars=True)`) it names,
    for each of `names` that is a per-expert name (`EXPERT_NAME`) absent from `state` whose layer holds its
    experts fused (gate: rows [0, f_e) of `gate_up_proj[e]`, up: rows [f_e, 2·f_e), down: `down_proj[e]`).
    Views are of the parameters' `.data` (no autograd). Names that match nothing are left out: the caller's
    unknown-name check reports them."""
    out: dict[str, torch.Tensor] = {}
    for name in names:
        m = EXPERT_NAME.match(name)
        if name in state or m is None:
            continue
        prefix, e, kind = m.group(1), int(m.group(2)), m.group(3)
        fused = state.get(f"{prefix}.{'down_proj' if kind == 'down_proj' else 'gate_up_proj'}")
        if fused is None or fused.dim() != 3 or e >= fused.shape[0]:
            continue
        data = fused.data[e]
        if kind != "down_proj":
            half = data.shape[0] // 2
            data = data[:half] if kind == "gate_proj" else data[half:]
        out[name] = data
    return out


def checkpoint_named(items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`items` with each fused expert tensor (`FUSED_NAME`: gate_up_proj [E, 2·f_e, h], down_proj [E, h, f_e])
    given as its experts' checkpoint names instead (e = 0..E−1: gate_proj, up_proj [f_e, h] (the first and
    second half of expert e's rows), down_proj [h, f_e]); views of the fused tensor, no copies. Other items
    pass unchanged, in order: a megatron actor's names (already per expert) and a dense model's are kept."""
    for name, t in items:
        m = FUSED_NAME.match(name)
        if m is None:
            yield name, t
            continue
        prefix, kind = m.groups()
        for e in range(t.shape[0]):
            if kind == "down_proj":
                yield f"{prefix}.{e}.down_proj.weight", t[e]
            else:
                gate, up = t[e].chunk(2, dim=0)
                yield f"{prefix}.{e}.gate_proj.weight", gate
                yield f"{prefix}.{e}.up_proj.weight", up


class CheckpointNames:
    """An actor engine whose `named_weights()` gives each expert under its checkpoint name (`checkpoint_named`),
    as SGLang's Qwen3-MoE loader reads them (it maps `experts.e.{gate,up,down}_proj.weight` onto its fused
    layers and knows no `experts.gate_up_proj`); every other attribute is the wrapped engine's."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from checkpoint_named(self.engine.named_weights())
