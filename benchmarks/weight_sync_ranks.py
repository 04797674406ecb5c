"""The multi-rank rows of benchmarks/weight_sync.py (issue 18): AWEX from every rank of a TP = 2 megatron actor to
2 HF engines, and the NCCL bandwidths its floors divide by, measured in the same run.

    method              mode      actor      engines    GPUs
    awex_tp2_colocate   colocate  TP 2 × DP 1  2 × TP 1  2 (engine e on trainer rank e's GPU)
    awex_tp2            separate  TP 2 × DP 1  2 × TP 1  4 (actor on GPUs 0-1, engines on GPUs 2-3)

A row needs its GPUs; elsewhere it is written as {"method", "size", "skipped": reason} (`skipped_row`), in the
table and the JSON. Each measured row carries `data_parallel`, `tensor_parallel`, `engines`, `bytes` (the HF
weights once), `bytes_per_trainer_rank` (what each trainer rank sends under awex's own transfer plan, from
`engines/weight_sync/awex_plan.bytes_per_trainer_rank` in bf16: every rank is a writer), the seconds, and
`allreduce_busbw_gbps`: a 2-rank NCCL all-reduce of 1 GiB over the actor's GPUs (median of 10; bus bandwidth
= algorithm bandwidth · 2(n−1)/n, the nccl-tests convention: the bytes one link carries per second).
floor_s = max(bytes_per_trainer_rank) / allreduce bus bandwidth (the ranks send at the same time, each over
its own link); `sync_floor_ratio` = sync_s / floor_s.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: Bytes of the buffer each bandwidth measurement moves, and its repeats (after 3 warm-ups).
BANDWIDTH_BYTES = 1 << 30
BANDWIDTH_REPEATS = 10
WARMUPS = 3


@dataclass(frozen=True, slots=True)
class RankMethod:
    """A multi-rank AWEX row's layout: awex mode, actor TP (DP 1), HF engines (TP 1 each), GPUs it needs."""

    mode: str
    tensor_parallel: int
    engines: int
    gpus: int


RANK_METHODS = {
    "awex_tp2_colocate": RankMethod("colocate", tensor_parallel=2, engines=2, gpus=2),
    "awex_tp2": RankMethod("separate", tensor_parallel=2, engines=2, gpus=4),
}


def skipped_row(method: str, size: str, gpus: int) -> dict[str, Any] | None:
    """The row of a multi-rank method that cannot run on `gpus` GPUs (None when it can)."""
    need = RANK_METHODS[method]
    if gpus >= need.gpus:
        return None
    return {
        "method": method, "size": size, "data_parallel": 1, "tensor_parallel": need.tensor_parallel,
        "skipped": f"needs {need.gpus} GPUs (AWEX {need.mode}: a TP {need.tensor_parallel} actor and "
        f"{need.engines} HF engines), found {gpus}",
    }  # fmt: skip


def _collective_rank(rank: int, world: int, port: int, op: str, out: Any) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    buf = torch.ones(BANDWIDTH_BYTES // 2, dtype=torch.bfloat16, device="cuda")
    times = []
    for i in range(BANDWIDTH_REPEATS + WARMUPS):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dist.broadcast(buf, src=0) if op == "broadcast" else dist.all_reduce(buf)
        torch.cuda.synchronize()
        if i >= WARMUPS:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        out.put(BANDWIDTH_BYTES / statistics.median(times) / 1e9)
    dist.destroy_process_group()


def nccl_gbps(port: int, op: str = "broadcast", world: int = 2) -> float:
    """GB/s of an NCCL `op` over GPUs 0..world-1, median: "broadcast" (GPU 0 → the others) bytes per second;
    "all_reduce" its bus bandwidth (module docstring)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_collective_rank, args=(r, world, port, op, out)) for r in range(world)]
    for p in procs:
        p.start()
    gbps = out.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    return gbps * 2 * (world - 1) / world if op == "all_reduce" else gbps


def plan_bytes(hf_config: dict[str, Any], method: str) -> list[int]:
    """Bytes each trainer rank sends under awex's transfer plan for `method`'s layout (bf16 weights)."""
    from mopd_hpc.engines.megatron.convert import Qwen3Shape
    from mopd_hpc.engines.weight_sync.awex import AwexJobConfig
    from mopd_hpc.engines.weight_sync.awex_plan import bytes_per_trainer_rank

    need = RANK_METHODS[method]
    cfg = AwexJobConfig(
        mode=need.mode, comm_backend="nccl", ipc_backend="cuda", meta_server_addr="", num_engines=need.engines,
        engine_tp=1, engine_pp=1, infer_world=need.engines, train_world=need.tensor_parallel,
        model_arch="Qwen3ForCausalLM",
    )  # fmt: skip
    shape = Qwen3Shape.from_hf_config(hf_config)
    return list(bytes_per_trainer_rank(shape, cfg, need.tensor_parallel, torch.bfloat16))


def rank_fields(method: str, per_rank: list[int], sync_s: float, busbw_gbps: float) -> dict[str, Any]:
    """The multi-rank fields of a measured row (module docstring)."""
    need = RANK_METHODS[method]
    floor_s = max(per_rank) / (busbw_gbps * 1e9)
    return {
        "data_parallel": 1, "tensor_parallel": need.tensor_parallel, "engines": need.engines,
        "bytes_per_trainer_rank": per_rank, "allreduce_busbw_gbps": round(busbw_gbps, 1),
        "floor_s": round(floor_s, 4), "sync_floor_ratio": round(sync_s / floor_s, 3),
    }  # fmt: skip
