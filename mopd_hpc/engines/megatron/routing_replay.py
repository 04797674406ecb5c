"""Rollout routing replay (R3) in the megatron actor's forward, through megatron-core's `RouterReplay`
(issue 33; `moe_enable_routing_replay`, megatron_core/transformer/moe/router_replay.py).

megatron-core's replay replaces a router's top k at every position by the target ids it is given. The torch
engine's (engines/moe_routing.py) replays only where the rollout recorded the experts (the positions that
predict a response token) and keeps the router's own choice elsewhere (−1 in the replay tensor);
`PartialRouterReplay` does the same: its top k is the router's own where the target is −1, the target
elsewhere, and the scores are the router's at those ids — with `norm_topk_prob` (megatron: softmax after the
top k) the softmax over the selected logits, i.e. the current router's probabilities at the replayed experts
renormalized, else the softmax over all E at them: the selection is fixed, the gate weights come from the
current router and stay differentiable (Ma et al. 2025, arXiv:2510.11370). The target stays set through the
backward (activation recompute replays too) until `end()`.

Layouts: the replay tensor [B, L, M, k] int64 (`moe_routing.replay_ids`); megatron's router sees the
positions sequence-first, [L·B, k] per layer (position p of row b at p·B + b).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay

from mopd_hpc.engines.batch import TrainBatch
from mopd_hpc.engines.moe_routing import replay_ids
from mopd_hpc.engines.protocol import EngineError


class PartialRouterReplay(RouterReplay):
    """megatron-core's `RouterReplay` that replays only where its target id is ≥ 0 (module docstring)."""

    def get_replay_topk(  # type: ignore[override]
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores at the ids [N, k], ids [N, k] int64) of `scores` [N, E]: the router's own top k where the
        target [N, k] is −1, else the target's ids."""
        values, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.target_topk_idx is None:
            return values, own
        forced = self.target_topk_idx.to(scores.device)
        ids = torch.where(forced >= 0, forced, own)
        return scores.gather(1, ids), ids


class MegatronRoutingReplay:
    """The replays of every router of a megatron model (none for a dense one), in layer order."""

    NONE: MegatronRoutingReplay  # of a model without routers

    def __init__(self, model: torch.nn.Module) -> None:
        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        #: one `PartialRouterReplay` per MoE layer, in layer order
        self.replays = []
        for router in routers:
            router.config.moe_enable_routing_replay = True  # what megatron-core builds a RouterReplay for
            router.router_replay = PartialRouterReplay()
            self.replays.append(router.router_replay)
        self.top_k = int(routers[0].topk) if routers else 0

    @property
    def layers(self) -> int:
        return len(self.replays)

    def start_batch(self, batch: TrainBatch) -> None:
        """Replay `batch.routed_experts` ([B, T, M, k], recorded at the positions predicting each response
        token) until `end()`; no replay without a recording.

        Raises:
            EngineError: a recording for a dense model, or of another layer count M or top k than the model's.
        """
        recorded, tokens = batch.routed_experts, batch.tokens
        if recorded is not None and tuple(recorded.shape[2:]) != (self.layers, self.top_k):
            raise EngineError(
                f"routed_experts records {recorded.shape[2]} MoE layers × {recorded.shape[3]} experts per token; "
                f"the megatron actor has {self.layers} MoE layers routing to {self.top_k} experts"
            )
        self.start(
            None
            if recorded is None
            else replay_ids(recorded, tokens.logit_positions, tokens.response_mask, tokens.input_ids.shape[1])
        )

    def start(self, replay: torch.Tensor | None) -> None:
        """Replay `replay` ([B, L, M, k] int64 expert ids, −1 = the router's own choice; None: no replay) in
        the forwards (and recomputes) until `end()`."""
        if replay is None:
            return self.end()
        k = replay.shape[-1]
        for m, r in enumerate(self.replays):
            r.target_topk_idx = replay[:, :, m].transpose(0, 1).reshape(-1, k)
        return None

    def end(self) -> None:
        """No replay: every router its own top k."""
        for r in self.replays:
            r.target_topk_idx = None


MegatronRoutingReplay.NONE = MegatronRoutingReplay(torch.nn.Module())
