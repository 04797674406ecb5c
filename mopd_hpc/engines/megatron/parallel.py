"""The megatron backend's process setup (DESIGN.md §5): the NCCL default group and megatron's parallel
state (`initialize_parallel`), and this rank's place in its TP and DP groups (`tp_info`,
`megatron_data_parallel`). GPU only (`initialize_parallel`); the others read megatron-core's parallel state.

Process setup (`initialize_parallel`): NCCL default process group (a gloo default group with a CUDA model
segfaulted in the first train step, algo_awex.md §4.1; world size 1 rendezvouses in an in-memory HashStore,
no TCP port), `initialize_model_parallel(tp, 1, expert_model_parallel_size=ep)`, the CUDA RNG tracker. Arguments are explicit (from
RankTopology at the edge), never read from the environment here.

Callers reach `tp_info` through this module (`parallel.tp_info()`) at call time, so a test's stand-in for it
applies to the engine, the scoring engine and `build.build_from_hf` alike.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mopd_hpc.engines.data_parallel import DataParallel
from mopd_hpc.engines.protocol import EngineError


def initialize_parallel(
    *,
    rank: int,
    world_size: int,
    tensor_parallel: int,
    device_index: int,
    expert_parallel: int = 1,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    seed: int = 0,
) -> torch.device:
    """NCCL default group + megatron parallel state (TP `tensor_parallel`, PP 1, EP `expert_parallel`: the
    expert-parallel group within the DP ranks, engines/megatron/expert_parallel.py) + CUDA RNG; returns the device.

    world_size 1 (a TP-1 teacher, a one-GPU actor) rendezvouses in memory (`dist.HashStore`): no TCP port.
    world_size > 1 uses `tcp://master_addr:master_port`. The NCCL group is bound to `cuda:device_index`
    (eager init). Idempotent: an initialized default group or parallel state is kept.

    Raises:
        EngineError: tensor_parallel does not divide world_size, expert_parallel does not divide the DP size
            world_size / tensor_parallel, rank is not in [0, world_size), or
            master_port is None with world_size > 1.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if world_size % tensor_parallel:
        raise EngineError(f"tensor_parallel={tensor_parallel} does not divide world_size={world_size}")
    if (world_size // tensor_parallel) % expert_parallel:
        raise EngineError(
            f"expert_parallel={expert_parallel} does not divide the data-parallel size "
            f"{world_size // tensor_parallel} (world_size {world_size} / tensor_parallel {tensor_parallel})"
        )
    if not 0 <= rank < world_size:
        raise EngineError(f"rank={rank}: expected in [0, world_size={world_size})")
    torch.cuda.set_device(device_index)
    device = torch.device("cuda", device_index)
    if not dist.is_initialized():
        if world_size == 1:
            dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
        else:
            if master_port is None:
                raise EngineError(f"master_port is None with world_size={world_size}; expected a TCP port")
            dist.init_process_group(
                "nccl", init_method=f"tcp://{master_addr}:{master_port}", rank=rank, world_size=world_size,
                device_id=device,
            )  # fmt: skip
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_parallel, 1, expert_model_parallel_size=expert_parallel
        )
    model_parallel_cuda_manual_seed(seed)
    return device


def tp_info() -> tuple[int, int, Any]:
    """(size, rank, process group) of this rank's megatron tensor-parallel group."""
    from megatron.core import parallel_state

    return (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_group(),
    )


def megatron_data_parallel() -> DataParallel:
    """This rank's place in megatron's data-parallel group (the ranks holding the same TP shard, different
    rows): `DataParallel.single()` at DP 1, else (rank, size, `parallel_state.get_data_parallel_group()`)."""
    from megatron.core import parallel_state

    size = parallel_state.get_data_parallel_world_size()
    if size == 1:
        return DataParallel.single()
    return DataParallel(
        parallel_state.get_data_parallel_rank(), size, parallel_state.get_data_parallel_group()
    )
