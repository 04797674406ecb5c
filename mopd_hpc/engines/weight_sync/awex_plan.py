"""AWEX transfer plans of a job, validated on CPU (issues 8, 18): awex 0.9.0's own `TransferPlanBuilder` builds
the inter-side plan (trainer ranks → rollout ranks) from parameter metadata that awex's own `ParamMetaResolver`
assembles (replicas, global offsets) with awex's own sharding strategies, out of what every rank holds; the
plan is then replayed on CPU tensors as in awex's tests/test_transfer_plan_cpu_sim.py: every rollout element
must be written exactly once, with the value the trainer holds. No GPU, NCCL or MetaServer is needed.

What every rank holds (HF canonical names, what AWEX's converters produce):
- trainer rank g = tp_rank + train_tp·dp_rank (config/parallel.py) holds its megatron pieces, as the
  actor's `ShardPlan(shape, train_tp)` says (q/k/v, gate/up, embeddings and lm_head dim 0; o/down dim 1;
  norms whole); awex's mcore sharding strategy must agree on every split dim, else AwexConfigError;
- rollout engine e's rank j (TP engine_tp) holds chunk j of the same split dims (the HF engine at TP 1:
  every tensor whole); AWEX numbering: rollout e·tp + j, trainer infer_world + g.

The plan is the same in both AWEX modes: separate mode sends it over one NCCL group; colocate mode has each
trainer rank's send plan executed by the rollout rank on its GPU (awex's NCCLWeightsReader, CUDA IPC), which
needs the (host, device) bijection that `plan/transfer_ranks.py` checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mopd_hpc.engines.megatron.shard_plan import ShardPlan
from mopd_hpc.engines.weight_sync.awex import AwexConfigError, AwexJobConfig, require_awex


@dataclass(frozen=True, slots=True)
class PlanCheck:
    """Result of `simulate_transfer_plan`.

    Attributes:
        op_count: P2P operations of the whole plan. numel: rollout elements written (each exactly once).
        params: HF parameters covered.
        bytes_per_trainer_rank: bytes trainer rank g sends (transfer rank infer_world + g), in the dtype the
            simulation was given, g = 0 … train_world − 1.
    """

    op_count: int
    numel: int
    params: int
    bytes_per_trainer_rank: tuple[int, ...]


def _rank_info(global_rank: int, world: int, tp: int, infer: bool) -> Any:
    from awex.sharding.rank_info import RankInfo

    t, d = global_rank % tp, global_rank // tp
    return RankInfo(
        tp_rank=t, tp_size=tp, pp_rank=0, pp_size=1, dp_size=world // tp, dp_rank=d, ep_rank=0, ep_size=1,
        ep_tp_rank=0, ep_tp_size=1, attn_tp_rank=t, attn_tp_size=tp, attn_dp_rank=d, world_size=world,
        global_rank=global_rank, local_rank=global_rank, engine_rank=0, is_infer=infer,
    )  # fmt: skip


def _piece(plan: ShardPlan, name: str, tp: int, padded: bool) -> tuple[int, ...]:
    """The shape of one rank's piece of `name` at TP `tp`: the actor's (padded vocabulary) or an engine's."""
    entry = plan.tensors[name]
    if padded:
        return entry.piece_shape
    shape = list(entry.hf_shape)
    if entry.dim is not None:
        if shape[entry.dim] % tp:
            raise AwexConfigError(
                f"rollout.engines.tensor_parallel={tp} does not divide dim {entry.dim} of {name} {entry.hf_shape}"
            )
        shape[entry.dim] //= tp
    return tuple(shape)


def _params_meta(plan: ShardPlan, world: int, tp: int, engine: str, dtype: Any, arch: str) -> list:
    """awex `ParameterMeta`s of one side (`engine` "mcore": the actor, `plan.tp` = tp, padded vocabulary;
    else one rollout engine of `tp` ranks), built by awex's own resolver with awex's sharding strategy."""
    from awex.meta.meta_resolver import ParamMetaResolver
    from awex.models import get_sharding_strategy

    infer = engine != "mcore"
    raw = [
        {
            "rank_info": _rank_info(g, world, tp, infer),
            "params_meta": [
                {"name": n, "numel": math.prod(s), "shape": s, "dtype": dtype, "vp_stage": 0}
                for n, s in ((n, _piece(plan, n, tp, not infer)) for n in plan.tensors)
            ],
            "model_arch_name": arch,
        }
        for g in range(world)
    ]
    strategy = get_sharding_strategy(arch)(
        engine_name=engine, enable_dp_attention=False, enable_dp_lm_head=False, moe_dense_tp_size=tp,
        tp_size=tp, ep_size=1, ep_tp_size=1, rank_info=raw[0]["rank_info"], device_backend=None,
    )  # fmt: skip

    class Resolver(ParamMetaResolver):
        def get_model_arch_name(self) -> str:
            return arch

        def get_parameters_meta(self) -> list:
            return self._build_params_meta()

        def _get_params_raw_meta(self) -> list:
            return raw

        def _get_sharding_info(self, name: str, rank_info: Any, param_meta: Any) -> Any:
            kind, dim, shards = strategy.get_sharding_strategy(
                name, rank_info=rank_info, param_meta=param_meta
            )
            ours = plan.tensors[name].dim if tp > 1 else None
            if (shards > 1) != (ours is not None) or (ours is not None and dim != ours):
                raise AwexConfigError(
                    f"{name}: awex's {engine} sharding strategy gives {kind.name} dim {dim} over {shards} ranks; "
                    f"the ranks hold it {'whole' if ours is None else f'split along dim {ours}'} (shard_plan.py)"
                )
            return kind, dim, shards

    return Resolver({"num_hidden_layers": plan.shape.num_layers}).get_parameters_meta()


def transfer_operations(
    shape: Any, cfg: AwexJobConfig, train_tp: int, dtype: Any
) -> tuple[ShardPlan, list, list]:
    """(the actor's ShardPlan, the rollout side's awex ParameterMetas, awex's CommunicationOperations) of this
    job's inter-side plan (`simulate_transfer_plan`'s Raises, but for the replay's)."""
    require_awex()
    from awex.transfer.transfer_plan import TransferPlanBuilder
    from awex.util.common import check_train_infer_params_meta

    if train_tp < 1 or cfg.train_world % train_tp:
        raise AwexConfigError(f"train_tp={train_tp} does not divide train_world={cfg.train_world}")
    plan = ShardPlan.create(shape, train_tp)
    train = _params_meta(plan, cfg.train_world, train_tp, "mcore", dtype, cfg.model_arch)
    engine = "hf" if cfg.engine_tp == 1 else "sglang"
    infer = _params_meta(plan, cfg.engine_tp, cfg.engine_tp, engine, dtype, cfg.model_arch)
    try:
        check_train_infer_params_meta(train, infer, raise_exception=True)
    except ValueError as exc:
        raise AwexConfigError(f"awex's train/infer metadata check: {exc}") from None
    builder = TransferPlanBuilder(cfg.infer_world, cfg.train_world, num_infer_engines=cfg.num_engines)
    return plan, infer, builder.build_weights_mapping_operations(infer, train)


def bytes_per_trainer_rank(shape: Any, cfg: AwexJobConfig, train_tp: int, dtype: Any) -> tuple[int, ...]:
    """Bytes trainer rank g sends in one sync under awex's plan (g = 0 … train_world − 1), in `dtype`; no
    replay (no tensors: cheap at real model sizes). Raises as `transfer_operations`."""
    return _sent_bytes(transfer_operations(shape, cfg, train_tp, dtype)[2], cfg, dtype)


def _sent_bytes(ops: list, cfg: AwexJobConfig, dtype: Any) -> tuple[int, ...]:
    sent = [0] * cfg.train_world
    for op in ops:
        sent[op.send_rank - cfg.infer_world] += math.prod(op.overlap_shape) * dtype.itemsize
    return tuple(sent)


def simulate_transfer_plan(shape: Any, cfg: AwexJobConfig, train_tp: int, dtype: Any = None) -> PlanCheck:
    """Build AWEX's inter-side transfer plan for this job (trainer TP `train_tp` × DP train_world/train_tp;
    `num_engines` rollout engines of TP `engine_tp`) with awex's TransferPlanBuilder, then replay it on CPU
    tensors: every rollout element must be written exactly once, with the trainer's value.

    Args:
        shape: the actor's `Qwen3Shape`. dtype: the weights' torch dtype (default float32), for the byte counts.

    Raises:
        AwexUnavailableError: awex (or megatron.core) is not installed.
        AwexConfigError: train_tp not dividing train_world; awex's sharding disagreeing with the ranks' pieces;
            awex's own train/infer metadata check failing (e.g. a padded vocabulary); the plan leaving an
            element unwritten, writing one twice, or moving a wrong value.
    """
    require_awex()
    import torch

    dtype = torch.float32 if dtype is None else dtype
    plan, infer, ops = transfer_operations(shape, cfg, train_tp, dtype)
    truth = {
        n: torch.arange(1, math.prod(e.hf_shape) + 1, dtype=torch.float32).view(e.hf_shape)
        for n, e in plan.tensors.items()
    }
    dst: dict[tuple[int, str, tuple[int, ...]], torch.Tensor] = {}
    written: dict[tuple[int, str, tuple[int, ...]], torch.Tensor] = {}
    for meta in infer:
        for engine_rank in range(cfg.num_engines):
            for shard in meta.shards:  # this engine's ranks: TP shards, or a whole copy per rank
                key = (engine_rank * cfg.engine_tp + shard.global_rank, meta.name, tuple(shard.global_offset))
                dst[key] = torch.zeros(shard.shape)
                written[key] = torch.zeros(shard.shape, dtype=torch.bool)
    numel = 0
    for op in ops:
        name = op.send_shard_meta.name
        if not cfg.infer_world <= op.send_rank < cfg.infer_world + cfg.train_world:
            raise AwexConfigError(
                f"op for {name} sends from transfer rank {op.send_rank}, not a trainer rank"
            )
        src_box = tuple(
            slice(o, o + s)
            for o, s in zip(op.send_shard_meta.global_offset, op.send_shard_meta.shape, strict=True)
        )
        src = truth[name][src_box][op.train_slices]
        key = (op.recv_rank, name, tuple(op.recv_shard_meta.global_offset))
        if key not in dst:
            raise AwexConfigError(f"op for {name} writes to rank {op.recv_rank}, which holds no such shard")
        if written[key][op.inf_slices].any():
            raise AwexConfigError(f"{name} on rollout transfer rank {op.recv_rank} is written twice")
        dst[key][op.inf_slices] = src
        written[key][op.inf_slices] = True
        numel += src.numel()
    for (rank, name, offset), mask in written.items():
        box = tuple(slice(o, o + s) for o, s in zip(offset, mask.shape, strict=True))
        if not mask.all() or not torch.equal(dst[(rank, name, offset)], truth[name][box]):
            raise AwexConfigError(
                f"{name} on rollout transfer rank {rank} (offset {offset}) is not fully written"
            )
    return PlanCheck(
        op_count=len(ops),
        numel=numel,
        params=len(plan.tensors),
        bytes_per_trainer_rank=_sent_bytes(ops, cfg, dtype),
    )
