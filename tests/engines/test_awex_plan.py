"""AWEX transfer plans of a job's rank layout, built by awex 0.9.0's own TransferPlanBuilder from metadata that
awex's own resolver and sharding strategies assemble, replayed on CPU tensors (`awex_plan.simulate_transfer_plan`):
every HF parameter element of every rollout rank is written exactly once, with the trainer's value, and every
trainer rank of a DP × TP actor is a writer (issue 18: the CPU part of "AWEX with every trainer rank a writer
at its transfer rank")."""

from __future__ import annotations

import math

import pytest
import torch

from mopd_hpc.engines.megatron.convert import Qwen3Shape
from mopd_hpc.engines.megatron.shard_plan import ShardPlan
from mopd_hpc.engines.weight_sync.awex import AwexConfigError, AwexJobConfig
from mopd_hpc.engines.weight_sync.awex_plan import PlanCheck, bytes_per_trainer_rank, simulate_transfer_plan

pytest.importorskip("awex", reason="awex (the awex extra) is not installed")

MICRO = Qwen3Shape.create(
    num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2, head_dim=8,
    ffn_hidden_size=32, vocab_size=64, tie_word_embeddings=False,
)  # fmt: skip
#: Bytes per element of the actor's bf16 weights (the byte counts below).
BF16_BYTES = 2


def _cfg(engines: int, engine_tp: int, train_world: int) -> AwexJobConfig:
    return AwexJobConfig(
        mode="separate", comm_backend="nccl", ipc_backend="cuda", meta_server_addr="h:1", num_engines=engines,
        engine_tp=engine_tp, engine_pp=1, infer_world=engines * engine_tp, train_world=train_world,
        model_arch="Qwen3ForCausalLM",
    )  # fmt: skip


def simulate_transfer_plan_bf16(cfg: AwexJobConfig, train_tp: int) -> PlanCheck:
    return simulate_transfer_plan(MICRO, cfg, train_tp=train_tp, dtype=torch.bfloat16)


def _expected_bytes(engines: int, engine_tp: int, train_tp: int, train_dp: int) -> list[int]:
    """The oracle, from the layout alone: engine e's copy of a split tensor comes from DP group e mod dp, each
    of its TP ranks sending its 1/train_tp of it; a whole tensor (a norm) has one replica per rollout rank
    (engines·engine_tp of them) and one per trainer rank, assigned round robin (awex's rule)."""
    plan = ShardPlan.create(MICRO, 1)
    split = sum(math.prod(e.hf_shape) for e in plan.tensors.values() if e.dim is not None)
    whole = sum(math.prod(e.hf_shape) for e in plan.tensors.values() if e.dim is None)
    world = train_tp * train_dp
    out = []
    for g in range(world):
        copies = sum(1 for e in range(engines) if e % train_dp == g // train_tp)
        replicas = sum(1 for i in range(engines * engine_tp) if i % world == g)
        out.append(BF16_BYTES * (copies * split // train_tp + replicas * whole))
    return out


@pytest.mark.parametrize(
    ("train_tp", "train_dp", "engines", "engine_tp"),
    [(2, 1, 2, 1), (2, 1, 1, 2), (2, 1, 2, 2), (2, 2, 4, 1), (2, 2, 2, 2), (2, 2, 1, 1), (1, 2, 2, 1)],
    ids=[
        "tp2dp1-2xengine-tp1-colocate2", "tp2dp1-1xengine-tp2", "tp2dp1-2xengine-tp2", "tp2dp2-4xengine-tp1",
        "tp2dp2-2xengine-tp2", "tp2dp2-1xengine-tp1", "tp1dp2-2xengine-tp1",
    ],
)  # fmt: skip
def test_every_rollout_element_once_and_every_trainer_rank_writes(
    train_tp: int, train_dp: int, engines: int, engine_tp: int
) -> None:
    cfg = _cfg(engines, engine_tp, train_tp * train_dp)
    check = simulate_transfer_plan_bf16(cfg, train_tp)
    plan = ShardPlan.create(MICRO, 1)
    assert check.params == len(plan.tensors) == 2 * 11 + 3
    split = sum(math.prod(e.hf_shape) for e in plan.tensors.values() if e.dim is not None)
    whole = sum(math.prod(e.hf_shape) for e in plan.tensors.values() if e.dim is None)
    assert check.numel == engines * (split + whole * engine_tp)  # every rollout rank's elements, once each
    assert list(check.bytes_per_trainer_rank) == _expected_bytes(engines, engine_tp, train_tp, train_dp)
    assert sum(check.bytes_per_trainer_rank) == BF16_BYTES * check.numel
    assert bytes_per_trainer_rank(MICRO, cfg, train_tp, torch.bfloat16) == check.bytes_per_trainer_rank
    if engines >= train_dp:  # every DP group serves an engine: every trainer rank is a writer
        assert all(b > 0 for b in check.bytes_per_trainer_rank)


def test_replay_catches_a_plan_that_misses_elements(monkeypatch: pytest.MonkeyPatch) -> None:
    from awex.transfer.transfer_plan import TransferPlanBuilder

    real = TransferPlanBuilder.build_weights_mapping_operations
    monkeypatch.setattr(
        TransferPlanBuilder, "build_weights_mapping_operations", lambda *a, **k: real(*a, **k)[:-1]
    )
    with pytest.raises(AwexConfigError, match="on rollout transfer rank .* is not fully written"):
        simulate_transfer_plan_bf16(_cfg(2, 1, 2), train_tp=2)


def test_a_padded_vocabulary_is_refused_by_awex_own_check() -> None:
    """megatron's padded embedding rows (V' > V) would reach awex as a [V', h] tensor the HF engine lacks."""
    padded = Qwen3Shape.create(**{**_fields(MICRO), "padded_vocab_size": 128})
    with pytest.raises(AwexConfigError, match=r"Inconsistent .* (model\.embed_tokens|lm_head)\.weight"):
        simulate_transfer_plan(padded, _cfg(2, 1, 2), train_tp=2)


def test_train_tp_must_divide_the_world() -> None:
    with pytest.raises(AwexConfigError, match="train_tp=2 does not divide train_world=3"):
        simulate_transfer_plan_bf16(_cfg(3, 1, 3), train_tp=2)


def _fields(shape: Qwen3Shape) -> dict:
    return {name: getattr(shape, name) for name in shape.__dataclass_fields__}


def test_awex_sharding_that_disagrees_with_the_actor_layout_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """awex's strategy must split every tensor as megatron's TP ranks hold it (shard_plan.py): a strategy that
    split q_proj along dim 1 would make awex read the wrong rows."""
    from awex.sharding.param_sharding import ShardingStrategy, ShardingType

    real = ShardingStrategy.get_sharding_strategy

    def q_by_columns(self, name, **kwargs):  # noqa: ANN001, ANN202
        if name.endswith("q_proj.weight") and self.rank_info.tp_size > 1:
            return ShardingType.TP_SHARDING, 1, self.rank_info.tp_size
        return real(self, name, **kwargs)

    monkeypatch.setattr(ShardingStrategy, "get_sharding_strategy", q_by_columns)
    with pytest.raises(
        AwexConfigError, match=r"q_proj\.weight: awex's mcore sharding strategy gives TP_SHARDING dim 1"
    ):
        simulate_transfer_plan_bf16(_cfg(2, 1, 2), train_tp=2)
