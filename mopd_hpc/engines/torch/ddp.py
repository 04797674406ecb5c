"""The torch train engine's model under torch DistributedDataParallel, one rank of a data-parallel group
(`engines/data_parallel.py`; DESIGN.md §7); `engine.py` scales the loss so the ranks sum to the step at DP = 1.
"""

from __future__ import annotations

import inspect

import torch

from mopd_hpc.engines.data_parallel import DataParallel
from mopd_hpc.engines.protocol import EngineError


def distributed_module(module: torch.nn.Module, dp: DataParallel, device: torch.device) -> torch.nn.Module:
    """`module` under torch DDP over `dp.group` (a collective: every rank builds it at the same time; rank 0's
    parameters are broadcast). Buffers are not broadcast per forward (the models' buffers are constants such
    as RoPE frequencies).

    Raises:
        EngineError: the group's backend cannot reduce tensors of `device` (NCCL with a CPU device).
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    backend = str(dist.get_backend(dp.group))
    if backend == "nccl" and device.type != "cuda":
        raise EngineError(
            f"data parallelism over a {backend!r} group needs a CUDA device; the actor is on {device} "
            "(use a gloo group on CPU)"
        )
    ids = None
    if device.type == "cuda":
        ids = [device.index if device.index is not None else torch.cuda.current_device()]
    # No buffer broadcast before each forward (torch >= 2.13 names it forward_sync_buffers).
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    no_sync = {"forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers": False}
    return DistributedDataParallel(module, device_ids=ids, process_group=dp.group, **no_sync)
