"""The routers of a transformers mixture-of-experts model (Qwen3-MoE): their logits captured for the router
losses, and their expert selection replayed (rollout routing replay, R3).

A router is the `gate` of an MoE block (a module with `gate` and `experts`; transformers 5
`Qwen3MoeTopKRouter`: `forward(h [N, H]) → (router_logits [N, E], scores [N, k], indices [N, k])`, scores the
softmax over the E logits at the k selected experts, renormalized to sum 1 when `norm_topk_prob`).
`RouterHooks` registers one forward hook per router, once, and stays registered:

- while `capturing`, each router call's logits [N, E] (N = B·L positions, carrying the gradient) are appended
  to `captured`, in layer order;
- while `recording`, each router call's selected ids [N, k] are appended to `recorded` (the rollout's record
  of the experts each token was routed to, `last_position_routes`);
- while `replay` is set ([B, L, M, k] int64 expert ids for the M MoE layers, −1 = the router's own choice at
  that position), the hook returns the recorded ids as the selection, and as scores the current router's
  softmax probabilities at those ids (renormalized when `norm_topk_prob`): the selection is fixed, the gate
  weights come from the current router and stay differentiable (R3: Ma et al. 2025, "Stabilizing MoE RL by
  aligning training and inference routers", arXiv:2510.11370). `replay` stays set through the backward, so
  activation recompute replays too.

Router losses over the captured logits, positions masked by `mask` [B, L] (1 = a real token):

- load balancing (Switch Transformer, Fedus et al. 2021, eqs. 4-6; transformers' `load_balancing_loss_func`):
  per layer f_i = the selections routed to expert i per position (the router's own top k; Σ_i f_i = k),
  P_i = mean router probability of expert i; loss = E · Σ_i f_i·P_i averaged over the M layers' positions
  (as transformers, counts and probabilities are summed over the layers before the product);
- z-loss (ST-MoE, Zoph et al. 2022, eq. 5): mean over the layers' positions of logsumexp(router logits)².
"""

from __future__ import annotations

from typing import Any

import torch


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The routers of `model` in layer order (the `gate` of every module with `gate` and `experts`)."""
    return [
        m.gate
        for m in model.modules()
        if isinstance(getattr(m, "gate", None), torch.nn.Module) and hasattr(m, "experts")
    ]


class RouterHooks:
    """The forward hooks on every router of a model (module docstring); `routers` is empty for a dense one."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = moe_routers(model)
        self.capturing = False
        self.captured: list[torch.Tensor] = []
        #: [B, L, M, k] int64 expert ids to replay (−1: the router's own choice), or None.
        self.replay: torch.Tensor | None = None
        self.recording = False
        self.recorded: list[torch.Tensor] = []
        for index, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(index))

    @property
    def moe(self) -> bool:
        return bool(self.routers)

    def _hook(self, index: int) -> Any:
        def hook(router: torch.nn.Module, args: tuple, output: tuple) -> tuple | None:
            logits, scores, ids = output
            if self.replay is not None:
                forced = self.replay[:, :, index].reshape(-1, ids.shape[-1]).to(ids.device)
                ids = torch.where(forced >= 0, forced, ids)
                probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
                picked = probs.gather(-1, ids)
                if getattr(router, "norm_topk_prob", False):
                    picked = picked / picked.sum(dim=-1, keepdim=True)
                scores = picked.to(logits.dtype)
            if self.capturing:
                self.captured.append(logits)
            if self.recording:
                self.recorded.append(ids.detach())
            return logits, scores, ids

        return hook

    def start(self, replay: torch.Tensor | None = None) -> None:
        """Begin a forward: clear the captured logits, capture, replay `replay` (None: no replay)."""
        self.captured = []
        self.capturing = True
        self.replay = replay

    def stop_capture(self) -> list[torch.Tensor]:
        """The forward ended: the captured [N, E] logits per MoE layer (replay stays set for the backward)."""
        self.capturing = False
        out, self.captured = self.captured, []
        return out

    def last_position_routes(self, rows: int) -> torch.Tensor:
        """The ids recorded since the last call, of a forward over `rows` rows: each row's last position's
        [M, k] (the position whose logits give the next token), as [rows, M, k] int16 on the CPU."""
        out, self.recorded = self.recorded, []
        last = [ids.reshape(rows, -1, ids.shape[-1])[:, -1] for ids in out]
        return torch.stack(last, dim=1).to(device="cpu", dtype=torch.int16)

    def end(self) -> None:
        """The backward ended: no replay."""
        self.capturing = False
        self.replay = None


def load_balancing_loss(logits: list[torch.Tensor], top_k: int, mask: torch.Tensor) -> torch.Tensor:
    """Switch Transformer load-balancing loss (module docstring) of the layers' router `logits` ([N, E] each,
    N = B·L) with the router's own top `top_k`, positions weighted by `mask` [B, L]. Float32 scalar; 0 when
    there are no layers."""
    if not logits:
        return torch.zeros((), device=mask.device)
    experts = logits[0].shape[-1]
    weight = mask.reshape(-1).to(torch.float32)
    counts = torch.zeros(experts, dtype=torch.float32, device=mask.device)
    probs_sum = torch.zeros(experts, dtype=torch.float32, device=mask.device)
    for layer in logits:
        probs = torch.softmax(layer.float(), dim=-1)
        top = probs.topk(top_k, dim=-1).indices
        counts = counts.scatter_add(0, top.reshape(-1), weight.repeat_interleave(top_k))
        probs_sum = probs_sum + (probs * weight[:, None]).sum(0)
    rows = weight.sum() * len(logits)
    return experts * torch.sum((counts / rows) * (probs_sum / rows))


def z_loss(logits: list[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss (module docstring): masked mean over the layers' positions of logsumexp²."""
    if not logits:
        return torch.zeros((), device=mask.device)
    weight = mask.reshape(-1).to(torch.float32)
    total = sum((torch.logsumexp(layer.float(), dim=-1) ** 2 * weight).sum() for layer in logits)
    return total / (weight.sum() * len(logits)).clamp(min=1.0)


def replay_ids(
    recorded: torch.Tensor, logit_positions: torch.Tensor, response_mask: torch.Tensor, length: int
) -> torch.Tensor:
    """[B, L, M, k] int64 expert ids to replay at every one of the L = `length` positions of a batch's rows
    (−1: the router's own choice), from the rollout's `recorded` [B, T, M, k] ids at the positions predicting
    each response token (`logit_positions` [B, T] int64, where `response_mask` [B, T] bool is set)."""
    mask = response_mask
    replay = torch.full(
        (mask.shape[0], length, *recorded.shape[2:]), -1, dtype=torch.int64, device=mask.device
    )
    rows = torch.arange(mask.shape[0], device=mask.device)[:, None].expand_as(mask)
    replay[rows[mask], logit_positions[mask]] = recorded.to(mask.device)[mask].long()
    return replay
