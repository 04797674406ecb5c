"""The router losses of a megatron MoE actor through megatron-core's own mechanisms (issue 33).

The coefficients (c_lb `loss.router_aux_loss_coefficient`, null = the checkpoint's `router_aux_loss_coef`;
c_z `loss.router_z_loss_coefficient`) are set on the model's shared `TransformerConfig`
(`moe_router_load_balancing_type="aux_loss"`, `moe_aux_loss_coeff`, `moe_z_loss_coeff`) and on each
`TopKRouter`'s `routing_type` (read at construction). In a train-mode forward with gradients, every MoE
layer's router then computes its loss and attaches it to its output through `MoEAuxLossAutoScaler`, whose
backward adds (per-layer coefficient) × `main_loss_backward_scale` to the gradient; padding is excluded by
GPTModel's `padding_mask` ([B, L] bool, True = padding; megatron_core/transformer/moe/router.py).

Per layer l over its N valid positions (megatron-core moe_utils.py): LB_l = E/(k·N²)·Σ_i P_i·T_i (T_i the
tokens routed to expert i by the router's own top k, P_i the summed softmax probabilities), Z_l = mean of
logsumexp(logits)². transformers' (and the torch engine's, engines/moe_routing.py) load-balancing loss is
E·Σ_i (T_i/N)·(P_i/N) = k·LB (k when balanced) once over the layers' pooled counts; its z-loss is the mean
of logsumexp² over every layer's positions. So that a coefficient means the same on both engines, each layer
gets moe_aux_loss_coeff = c_lb·k/M and moe_z_loss_coeff = c_z/M over the M MoE layers: the gradient is that
of c_lb·mean_l(k·LB_l) + c_z·mean_l(Z_l). With one MoE layer both equal the torch engine's exactly; with
several, the load-balancing term is megatron's per-layer one (ST-MoE, Megatron-LM) averaged, not pooled.

Micro-batch weighting as the torch engine's: the terms of a micro-batch carrying a share s of the step's
response tokens are weighted by s (× DP size, as the main loss's backward, which megatron's DDP averages).
Statistics (`router/load_balancing_loss` = mean_l k·LB_l, `router/z_loss` = mean_l Z_l, before their
coefficients) are read from megatron's aux-loss tracker after the backward (with activation recompute the
losses are computed in the backward's recompute), then the tracker is cleared with megatron-core's own
`clear_aux_losses_tracker` (megatron-core ≥ 0.17's `get_moe_layer_wise_logging_tracker` returns a copy, so
taking an entry out of it cleared nothing: on an H100 with 0.19.2 the statistic summed over the steps,
6.1 → 12.3 → 18.0).
The step's `loss` metric includes share·(c_lb·L_lb + c_z·L_z), as the torch engine's (`weighted`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    clear_aux_losses_tracker,
    get_moe_layer_wise_logging_tracker,
)
from megatron.core.transformer.moe.router import TopKRouter

from mopd_hpc.config.loss import LossConfig
from mopd_hpc.engines.batch import TokenBatch
from mopd_hpc.engines.protocol import EngineError


class MegatronRouterLosses:
    """The router losses switched on in a megatron model (module docstring); inert for c_lb = c_z = 0."""

    INERT: MegatronRouterLosses  # no router loss (a dense model, or both coefficients 0)

    def __init__(self, model: torch.nn.Module, hf_config: Mapping[str, Any], loss: LossConfig) -> None:
        """Set the coefficients on `model` (a GPTModel, or any module holding megatron MoE layers).

        Raises:
            EngineError: a coefficient > 0 for a model without MoE layers (no router).
        """
        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        aux, z = loss.router_aux_loss_coefficient, loss.router_z_loss_coefficient
        if not routers and ((aux or 0.0) > 0 or z > 0):
            raise EngineError(
                f"loss.router_aux_loss_coefficient={aux}, loss.router_z_loss_coefficient={z}: the actor is a "
                "dense model (no router); expected null and 0"
            )
        #: c_lb (transformers' definition), c_z; 0 for a dense model.
        self.aux = (
            (float(hf_config.get("router_aux_loss_coef") or 0.0) if aux is None else aux) if routers else 0.0
        )
        self.z = z if routers else 0.0
        self.layers = len(routers)
        if not self.active:
            return
        config = routers[0].config  # shared by every submodule
        self.top_k = int(config.moe_router_topk)
        if self.aux > 0:
            config.moe_router_load_balancing_type = "aux_loss"
            config.moe_aux_loss_coeff = self.aux * self.top_k / self.layers
            for router in routers:
                router.routing_type = "aux_loss"
        config.moe_z_loss_coeff = self.z / self.layers if self.z > 0 else None

    @property
    def active(self) -> bool:
        return self.aux > 0 or self.z > 0

    def scale(self, share: float, dp_size: int = 1) -> None:
        """Weight the next backward's router terms by `share` (this micro-batch's share of the step's
        response tokens) × `dp_size` (megatron's DDP divides every gradient by it)."""
        if self.active:
            MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(share * dp_size))

    def collect(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The router-loss statistics of the forward/backward since the last call (module docstring; float32
        scalars on `device`, {} when inactive), and the tracker cleared."""
        if not self.active:
            return {}
        tracker = get_moe_layer_wise_logging_tracker()
        out = {}
        for name, key, factor in (
            ("load_balancing_loss", "router/load_balancing_loss", self.top_k),
            ("z_loss", "router/z_loss", 1),
        ):
            values = tracker.get(name, {}).get("values")
            total = values.sum().float().to(device) if values is not None else torch.zeros((), device=device)
            out[key] = total * factor / self.layers
        clear_aux_losses_tracker()  # megatron-core's own tracker (≥ 0.17: `tracker` is a copy of it)
        tracker.clear()  # ≤ 0.16: `tracker` is the tracker itself; entries sized by the next model's layers
        return out

    def weighted(self, stats: dict[str, torch.Tensor], share: float) -> torch.Tensor | float:
        """share·(c_lb·L_lb + c_z·L_z) of `collect`'s statistics: what the router terms add to the micro-batch's
        loss (the torch engine's `loss` metric includes them); 0 when inactive."""
        if not self.active:
            return 0.0
        return share * (self.aux * stats["router/load_balancing_loss"] + self.z * stats["router/z_loss"])


MegatronRouterLosses.INERT = MegatronRouterLosses(torch.nn.Module(), {}, LossConfig())


def padding_kwargs(batch: TokenBatch, on: bool, device: torch.device) -> dict[str, torch.Tensor]:
    """GPTModel's `padding_mask` keyword when `on`: [B, L] bool, True = padding (`batch.attention_mask` 0);
    {} when off (megatron then counts every position)."""
    return {"padding_mask": ~batch.attention_mask.to(device).bool()} if on else {}
