"""The distributed optimizer's parameter state in a checkpoint of an expert-parallel megatron actor (issue 33).

At expert_parallel EP > 1 megatron-core's `get_megatron_optimizer` builds two distributed optimizers: the
dense parameters' (sharded over the DP group) and the experts' (sharded over the expert-data-parallel group,
each EP rank's over other experts); at EP 1 one holds both. `optimizer_state.gather` gathers each to its DP
rank 0, which at EP > 1 leaves EP ranks > 0's expert state on their own ranks; here every EP rank's list
(per distributed optimizer: its dp_zero dict on that optimizer's DP rank 0, else None) is gathered to global
rank 0 over its EP group (`gather`), and scattered back at load (`scatter`):

    {"expert_parallel": EP, "ranks": [EP rank 0's list, ..., EP rank EP−1's list]}

written as the checkpoint's `optimizer_state.PARAM_STATE_FILE` (its own file) with `layout(EP)` in model.pt,
which every rank reads to know the saved EP size before any collective. A checkpoint resumes exactly (the
fp32 main params and Adam's moments bitwise) at the EP size it was saved at; at another EP size (an EP 1
checkpoint at EP 2, or the reverse) the optimizers' flat buffers hold other parameters (and their count
differs), so Adam starts again (moments 0, its own step count 0; checkpoint_state.py skips the optimizer's
state_dict) while the weights (the full expert set of the checkpoint's model), the engine's step count and
the lr schedule are restored exactly, and the load says so in the log.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from mopd_hpc.engines.megatron import optimizer_state

log = logging.getLogger(__name__)

#: The key of the saved EP size in the layout (`optimizer_state.PARAM_LAYOUT_KEY`'s value at EP > 1).
EP_KEY = "expert_parallel"


def layout(ep: int) -> dict[str, int]:
    """What model.pt holds under `optimizer_state.PARAM_LAYOUT_KEY` for an EP > 1 checkpoint."""
    return {EP_KEY: ep}


def saved_expert_parallel(saved_layout: Any) -> int:
    """The EP size a checkpoint's parameter state was saved at, from its layout (1: a list, or None)."""
    return int(saved_layout[EP_KEY]) if isinstance(saved_layout, Mapping) else 1


def gather(optimizer: Any, group: Any) -> dict[str, Any] | None:
    """Every distributed optimizer's dp_zero state, per EP rank, on global rank 0 (module docstring; a
    collective over each optimizer's DP group and over the EP `group`: every rank calls it); None elsewhere."""
    states = [opt.get_parameter_state_dp_zero() for opt in optimizer_state.distributed_optimizers(optimizer)]
    dst = dist.get_global_rank(group, 0)
    gathered: list[Any] | None = [None] * group.size() if dist.get_rank() == dst else None
    dist.gather_object(states, gathered, dst=dst, group=group)
    return {EP_KEY: group.size(), "ranks": gathered} if dist.get_rank() == 0 else None


def scatter(optimizer: Any, saved: Any, saved_ep: int, ep: int, group: Any) -> bool:
    """Load a saved parameter state (`saved`: on global rank 0 what `gather` returned, or an EP 1 checkpoint's
    `optimizer_state.gather` list; None elsewhere) saved at EP `saved_ep` into this rank's optimizers (a
    collective over this rank's EP `group` of `ep` ranks (None at EP 1) and each optimizer's DP group: every
    rank calls it with the same checkpoint), after `optimizer.load_state_dict` and the weights. Returns True when loaded exactly; False
    when the EP sizes differ and nothing was loaded (Adam starts again: module docstring).

    Raises:
        optimizer_state.OptimizerStateError: this rank's saved state does not fit its optimizer.
    """
    opts = optimizer_state.distributed_optimizers(optimizer)
    if saved_ep != ep:
        log.warning(
            "the checkpoint's optimizer state was saved at expert_parallel %d, this run is at %d: Adam starts "
            "again (moments 0; the weights, every expert's, the step and the lr schedule are the checkpoint's)",
            saved_ep,
            ep,
        )
        return False
    src = dist.get_global_rank(group, 0)
    ranks = None
    if dist.get_rank() == src:
        ranks = saved["ranks"] if isinstance(saved, Mapping) else [None] * group.size()
    mine: list[Any] = [None]
    dist.scatter_object_list(mine, ranks, src=src, group=group)
    states = mine[0] or [None] * len(opts)
    for opt, state in zip(opts, states, strict=True):
        if state is not None:
            found = optimizer_state.problems(state, opt)
            if found:
                raise optimizer_state.OptimizerStateError("; ".join(found))
        optimizer_state.load_dp_zero(opt, state)
    return True
