"""AWEX transfer plans of a job, validated on CPU (issue 8): awex 0.9.0's own `TransferPlanBuilder` builds
the inter-side plan (trainer ranks → rollout ranks, separate mode) from parameter metadata derived from a
Qwen3 shape and the job's layout, and the plan is replayed on CPU tensors as in awex's
tests/test_transfer_plan_cpu_sim.py: every rollout element must be written exactly once, with the value
the trainer holds. No GPU, NCCL or MetaServer is needed.

Metadata (HF canonical names, what AWEX's converters produce): q/k/v, gate/up, embeddings and lm_head split
dim 0 across tensor-parallel ranks, o/down dim 1, norms replicated (one replica per rank). The trainer has
train_world/train_tp data-parallel replicas; each rollout engine has engine_tp ranks (AWEX numbering:
rollout e·tp + j, trainer infer_world + r). Colocate mode moves weights by CUDA IPC instead and needs the
(host, device) bijection that `runtime/layout.py` checks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mopd_hpc.engines.weight_sync.awex import AwexConfigError, AwexJobConfig, require_awex


@dataclass(frozen=True, slots=True)
class PlanCheck:
    """Result of `simulate_transfer_plan`: op_count, elements moved, parameters covered."""

    op_count: int
    numel: int
    params: int


def _metas(
    shapes: Mapping[str, tuple[tuple[int, ...], int | None]], world: int, tp: int, engine: int
) -> list:
    import torch
    from awex.meta.meta_resolver import ParameterMeta, ParameterReplicaMeta, ParameterShardMeta
    from awex.sharding.param_sharding import ShardingType

    out = []
    for name, (shape, dim) in shapes.items():
        if dim is None:  # replicated: every rank holds the whole tensor, one replica per rank
            groups = [[(r, 0, tuple(shape), (0,) * len(shape))] for r in range(world)]
        else:  # one replica per data-parallel group of tp ranks, split along dim
            cut = shape[dim] // tp
            local = tuple(cut if i == dim else n for i, n in enumerate(shape))
            offsets = [tuple(t * cut if i == dim else 0 for i in range(len(shape))) for t in range(tp)]
            groups = [[(dp * tp + t, t, local, offsets[t]) for t in range(tp)] for dp in range(world // tp)]
        kind = ShardingType.NO_SHARDING if dim is None else ShardingType.TP_SHARDING
        common = dict(pp_rank=0, ep_rank=0, ep_tp_rank=0, world_size=world, engine_rank=engine, name=name)
        common |= dict(dtype=torch.float32, sharding_type=kind, num_shards=1 if dim is None else tp)
        replicas = [
            ParameterReplicaMeta(
                shards=[
                    ParameterShardMeta(
                        tp_rank=t,
                        attn_tp_rank=t,
                        global_rank=rank,
                        shape=part,
                        numel=math.prod(part),
                        global_offset=offset,
                        sharding_dim=dim or 0,
                        **common,
                    )  # fmt: skip
                    for rank, t, part, offset in group
                ]
            )
            for group in groups
        ]
        shards = [s for r in replicas for s in r.shards]
        numel, dims = math.prod(shape), tuple(shape)
        out.append(
            ParameterMeta(
                name,
                global_numel=numel,
                global_shape=dims,
                dtype=torch.float32,
                shards=shards,
                replicas=replicas,
            )
        )
    return out


def qwen3_param_shapes(shape: Any) -> dict[str, tuple[tuple[int, ...], int | None]]:
    """HF Qwen3 parameter name → (global shape, TP split dim or None) — the canonical names AWEX plans use
    (q/k/v, gate/up and embeddings column-parallel, o/down row-parallel, norms replicated)."""
    h, f, d = shape.hidden_size, shape.ffn_hidden_size, shape.head_dim
    hq, hkv, v = shape.num_attention_heads * d, shape.num_query_groups * d, shape.padded_vocab_size
    out: dict[str, tuple[tuple[int, ...], int | None]] = {"model.embed_tokens.weight": ((v, h), 0)}
    for n in range(shape.num_layers):
        p = f"model.layers.{n}."
        out |= {
            p + "input_layernorm.weight": ((h,), None),
            p + "self_attn.q_proj.weight": ((hq, h), 0),
            p + "self_attn.k_proj.weight": ((hkv, h), 0),
            p + "self_attn.v_proj.weight": ((hkv, h), 0),
            p + "self_attn.q_norm.weight": ((d,), None),
            p + "self_attn.k_norm.weight": ((d,), None),
            p + "self_attn.o_proj.weight": ((h, hq), 1),
            p + "post_attention_layernorm.weight": ((h,), None),
            p + "mlp.gate_proj.weight": ((f, h), 0),
            p + "mlp.up_proj.weight": ((f, h), 0),
            p + "mlp.down_proj.weight": ((h, f), 1),
        }
    out["model.norm.weight"] = ((h,), None)
    if not shape.tie_word_embeddings:
        out["lm_head.weight"] = ((v, h), 0)
    return out


def simulate_transfer_plan(shape: Any, cfg: AwexJobConfig, train_tp: int) -> PlanCheck:
    """Build AWEX's inter-side transfer plan for this job (trainer TP `train_tp` × DP train_world/train_tp;
    `num_engines` rollout engines of TP `engine_tp`) with awex's TransferPlanBuilder, then replay it on CPU
    tensors: every rollout element must be written exactly once, with the trainer's value.

    Raises:
        AwexUnavailableError: awex (or megatron.core) is not installed.
        AwexConfigError: the plan leaves an element unwritten, writes one twice, or moves a wrong value.
    """
    require_awex()
    import torch
    from awex.transfer.transfer_plan import TransferPlanBuilder

    if cfg.train_world % train_tp:
        raise AwexConfigError(f"train_tp={train_tp} does not divide train_world={cfg.train_world}")
    shapes = qwen3_param_shapes(shape)
    train = _metas(shapes, cfg.train_world, train_tp, 0)
    infer = _metas(shapes, cfg.engine_tp, cfg.engine_tp, 0)
    builder = TransferPlanBuilder(cfg.infer_world, cfg.train_world, num_infer_engines=cfg.num_engines)
    ops = builder.build_weights_mapping_operations(infer, train)
    truth = {
        n: torch.arange(1, math.prod(s) + 1, dtype=torch.float32).view(s) for n, (s, _) in shapes.items()
    }
    dst: dict[tuple[int, str, tuple[int, ...]], torch.Tensor] = {}
    written: dict[tuple[int, str, tuple[int, ...]], torch.Tensor] = {}
    for meta in infer:
        for engine in range(cfg.num_engines):
            for shard in meta.shards:  # this engine's ranks: TP shards, or a whole copy per rank
                key = (engine * cfg.engine_tp + shard.global_rank, meta.name, tuple(shard.global_offset))
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
    return PlanCheck(op_count=len(ops), numel=numel, params=len(shapes))
