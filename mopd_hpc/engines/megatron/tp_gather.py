"""The HF weights of a tensor-parallel actor, gathered one HF tensor at a time over its TP group.

Every TP rank of the actor holds its megatron shards (its GPTModel's state dict). For weight sync and the
HF export, the ranks of ONE TP group (the one of data-parallel rank 0: the others hold the same weights)
walk the `ShardPlan` in HF order together; per HF tensor each rank cuts its piece out of its own megatron
state (`ShardPlan.hf_piece`), one all-gather over the TP group gives every rank the pieces, and
`ShardPlan.gather` lays them out as the HF tensor (vocabulary padding dropped). Replicated tensors (the norms)
need no collective: the local copy is the tensor (megatron's `finalize_model_grads` keeps them equal over
TP; `check_replicated` all-gathers them too and raises if the ranks differ). TP rank 0 then hands each
tensor to the sender (`TorchBroadcastSender.send`, which broadcasts to the rollout group as at TP 1);
the other ranks take part in the gathers and drop the tensors.

Memory: one HF tensor (its T pieces) at a time on top of the model, never the whole model's megatron state
(the all-gather of `MegatronTrainEngine.full_mcore_state`). Its consumers may hold more: `TorchSync.push`
(trainer/weight_sync.py) lists every gathered tensor before sending, so TP rank 0 holds the whole HF model on
its device, and the "flattened_bucket" send concatenates it per dtype, a second copy; streaming the gathered
tensors into one broadcast each (the specs are known from the shard plan) is not built. Every rank of the TP group must iterate
`gathered_hf_weights` to the end, in the same order: a rank that stops early leaves the others in an
all-gather until the collective timeout.

Backends: whatever the group's is (gloo with CPU tensors in the tests, NCCL with the ranks' CUDA tensors).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from mopd_hpc.engines.megatron.convert import ConversionError
from mopd_hpc.engines.megatron.shard_plan import ShardPlan


def _all_gather(piece: torch.Tensor, tp: int, group: Any) -> list[torch.Tensor]:
    parts = [torch.empty_like(piece) for _ in range(tp)]
    dist.all_gather(parts, piece, group=group)
    return parts


def gathered_hf_weights(
    plan: ShardPlan,
    local: Mapping[str, torch.Tensor],
    group: Any = None,
    check_replicated: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, whole HF tensor) of every tensor of `plan`, in HF order, on every rank of the TP group.

    Args:
        plan: the model's `ShardPlan` at the group's size (plan.tp ranks).
        local: this rank's megatron state dict (detached tensors on the group's device).
        group: the TP process group (None: WORLD); its size must be plan.tp.
        check_replicated: also all-gather the replicated tensors and compare them.

    Raises:
        ConversionError: the group's size is not plan.tp, a megatron tensor is missing or misshapen, or (with
            check_replicated) a replicated tensor differs between TP ranks.
        RuntimeError (torch's DistError): a rank of the group failed or timed out in an all-gather.
    """
    if plan.tp > 1:
        size = dist.get_world_size(group)
        if size != plan.tp:
            raise ConversionError(
                f"the TP group has {size} ranks; the shard plan is for tensor_parallel={plan.tp}"
            )
    for name, entry in plan.tensors.items():
        piece = plan.hf_piece(name, local)
        if plan.tp == 1 or (entry.kind == "replicated" and not check_replicated):
            yield name, plan.gather(name, [piece] * plan.tp)
            continue
        yield name, plan.gather(name, _all_gather(piece.contiguous(), plan.tp, group))
