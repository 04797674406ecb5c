"""Expert parallelism of the megatron actor (issue 33): the experts of each MoE layer split over an
expert-parallel (EP) group, the dense parts data-parallel as at EP 1.

megatron-core's layout (`parallel_state.initialize_model_parallel(expert_model_parallel_size=EP)`, 0.16.1):
the EP group is formed within the data-parallel ranks (EP divides world / (TP·PP); with TP = PP = 1 the EP
groups are runs of EP consecutive ranks, {0, 1}, {2, 3}, ...), EP rank r holds the E/EP experts
r·E/EP … (r+1)·E/EP − 1 of every MoE layer as its `local_experts.0 … E/EP − 1`, and the expert-data-parallel
group (the ranks holding the same experts, size DP/EP) reduces their gradients: megatron's DDP keeps them in
its `expert_parallel_buffers`, scaled by 1/DP before the sum over that group (DDP's
`expert_gradient_scaling_factor`), so a DP = n, EP = m step updates every weight as the DP = n, EP = 1 step
does. The router and everything else stay replicated over the whole DP group.

Token dispatch (`TransformerConfig.moe_token_dispatcher_type`, `token_dispatcher`): "alltoall" on GPUs
(megatron-core's choice for EP: all_to_all_single over the EP group; it builds a CUDA stream at construction,
so it does not build on CPU) and "allgather" elsewhere (all_gather_into_tensor then reduce_scatter_tensor over
the EP group, both of which gloo runs on CPU in torch 2.13: the CPU tests' dispatcher).

What leaves the rank needs every expert: `gather_experts` all-gathers each local expert tensor over the EP
group and names it by its global index (weight sync, evaluation, the HF export and the checkpoint's model:
the full expert set, loadable at any EP size); `shard_experts` keeps this EP rank's experts of a full state,
renumbered (model build and checkpoint load).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

#: A megatron expert tensor's name: (prefix up to `local_experts.`, the local index, the rest).
_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..+)$")


def ep_info() -> tuple[int, int, Any]:
    """(size, rank, process group) of this rank's megatron expert-parallel group (size 1, rank 0, the group
    megatron made, at expert_model_parallel_size 1)."""
    from megatron.core import parallel_state

    return (
        parallel_state.get_expert_model_parallel_world_size(),
        parallel_state.get_expert_model_parallel_rank(),
        parallel_state.get_expert_model_parallel_group(),
    )


def token_dispatcher(expert_parallel: int, device_type: str) -> str:
    """megatron-core's MoE token dispatcher for `expert_parallel` on `device_type` ("cuda", "cpu"): "alltoall"
    at EP > 1 on CUDA, else "allgather" (module docstring)."""
    return "alltoall" if expert_parallel > 1 and device_type == "cuda" else "allgather"


def _split(name: str) -> tuple[str, int, str] | None:
    m = _LOCAL_EXPERT.match(name)
    return None if m is None else (m.group(1), int(m.group(2)), m.group(3))


def shard_experts(
    state: Mapping[str, torch.Tensor], num_experts: int, ep: int, rank: int
) -> dict[str, torch.Tensor]:
    """The part of a full megatron state (every expert, global indices) that EP rank `rank` of `ep` holds: its
    experts rank·E/ep … (rank+1)·E/ep − 1 renumbered from 0; every other tensor as it is. ep 1: `state`.

    Raises:
        ValueError: ep does not divide num_experts, or rank is not in [0, ep).
    """
    if ep == 1:
        return dict(state)
    if num_experts % ep or not 0 <= rank < ep:
        raise ValueError(f"expert_parallel {ep} (rank {rank}) does not split {num_experts} experts evenly")
    local = num_experts // ep
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        parts = _split(name)
        if parts is None:
            out[name] = t
        elif rank * local <= parts[1] < (rank + 1) * local:
            out[f"{parts[0]}{parts[1] - rank * local}{parts[2]}"] = t
    return out


def gather_experts(
    local: Mapping[str, torch.Tensor], num_experts: int, ep: int, group: Any
) -> dict[str, torch.Tensor]:
    """Inverse of `shard_experts` over the EP `group` (a collective: every rank of the group calls it with its
    own state, the same names in the same order): each local expert tensor all-gathered and named by its
    global index r·E/ep + i; every other tensor as it is (replicated over the group). ep 1: `local`.

    Raises:
        ValueError: the state holds another number of local experts than E/ep per layer.
    """
    if ep == 1:
        return dict(local)
    per_rank = num_experts // ep
    out: dict[str, torch.Tensor] = {}
    for name, t in local.items():
        parts = _split(name)
        if parts is None:
            out[name] = t
            continue
        if parts[1] >= per_rank:
            raise ValueError(
                f"{name}: local expert {parts[1]}, expected < {per_rank} (E {num_experts} / EP {ep})"
            )
        pieces = [torch.empty_like(t) for _ in range(ep)]
        dist.all_gather(pieces, t.contiguous(), group=group)
        for r, piece in enumerate(pieces):
            out[f"{parts[0]}{r * per_rank + parts[1]}{parts[2]}"] = piece
    return out


def group_max(count: int, group: Any, device: torch.device) -> int:
    """The largest `count` of the ranks of `group` (an all-reduce MAX, a collective over it)."""
    most = torch.tensor([count], dtype=torch.int64, device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
    return int(most.item())
