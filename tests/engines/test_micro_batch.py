"""Micro-batched train steps in the torch engine: 1, 2 and 5 micro-batches compute the one-batch step.

On one recorded batch (8 rows of lengths 7, 3, 4, 4, 8, 4, 5, 7 positions, one empty response, two teachers,
an off-policy μ, a reference model, GRPO advantages) the engine runs one step with `micro_batch_tokens`
None (the reference: one micro-batch, rows in order) and with budgets that split it into 1 (sorted), 2 and 5
micro-batches, for both estimators, both normalizers, with and without an RL term. Asserted in float64 (the
float32 checkpoint cast to float64): loss, grad norm and gradient (AdamW's first exp_avg = (1 − β1)·g) within 1e-10
relative, every statistic within 1e-6 (they are the losses' float32 outputs); in float32 the gradient within
1e-6 relative norm. Activation checkpointing changes nothing but memory (float64, 1e-12).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers_dp import PROMPTS, load_record, record_step, run_case
from pydantic import ValidationError

from mopd_hpc.config.loss import LossConfig
from mopd_hpc.config.models import ActorConfig, OptimizerConfig
from mopd_hpc.engines.batch import BatchError
from mopd_hpc.engines.data_parallel import DataParallel
from mopd_hpc.engines.micro_batch import (
    MicroBatchError,
    MicroBatching,
    StepStats,
    is_additive,
    plan_rows,
    split_rows,
)
from mopd_hpc.engines.torch.engine import TorchTrainEngine

#: micro_batch_tokens → micro-batches of the recorded batch (rows sorted by length 8, 7, 7, 5, 4, 4, 4, 3):
#: 64 = 8 rows · 8 positions; 32: 4 · 8 then 4 · 4; 12: [8] [7] [7] [5, 4] [4, 4, 3].
BUDGETS = {64: 1, 32: 2, 12: 5}
RTOL_FLOAT64 = 1e-10
#: Measured in float32: gradients within 5.7e-7 relative of the one-batch step, the loss's terms of both
#: signs amplifying float32 rounding of the different summation order.
RTOL_FLOAT32 = 1e-6

CASES = [
    pytest.param(est, norm, rl, id=f"{est}-{norm}-{'rl' if rl else 'distill'}")
    for est in ("sampled", "topk")
    for norm in ("token-mean", "seq-mean-token-mean")
    for rl in (False, True)
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict[str, Path]:
    return record_step(tmp_path_factory.mktemp("micro"))


def flat(named: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([named[n].double().flatten() for n in sorted(named)])


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def loss_section(estimator: str, normalizer: str, rl: bool) -> dict[str, object]:
    loss: dict[str, object] = {"estimator": estimator, "normalizer": normalizer, "topk": 4}
    if rl:
        loss |= {"rl_coefficient": 0.5, "kl_coefficient": 0.05}
        if estimator == "sampled":
            loss["orm_alpha"] = 0.3
    return loss


def one_step(recorded, loss, **extra) -> dict:
    case = {"model": str(recorded["model"]), "batch": str(recorded["batch"]), "loss": loss}
    return run_case(DataParallel.single(), case | {"bounds": [(0, len(PROMPTS))]} | extra)


@pytest.mark.parametrize(("estimator", "normalizer", "rl"), CASES)
def test_micro_batches_give_the_one_batch_step_in_float64(recorded, estimator, normalizer, rl):
    loss = loss_section(estimator, normalizer, rl)
    want = one_step(recorded, loss, dtype="float64")
    ws, g1 = want["stats"], flat(want["exp_avg"])
    assert ws["micro_batches"] == 1 and g1.norm() > 0 and abs(ws["loss"]) > 1e-4
    if rl:
        assert ws["grpo/loss"] != 0
    for budget, count in BUDGETS.items():
        got = one_step(recorded, loss, dtype="float64", micro_batch_tokens=budget)
        gs = got["stats"]
        grad_rel = float((flat(got["exp_avg"]) - g1).norm() / g1.norm())
        print(f"{estimator} {normalizer} rl={rl} {count} micro-batches: grad rel {grad_rel:.2e}, "
              f"loss rel {rel(gs['loss'], ws['loss']):.2e}")  # fmt: skip
        assert gs["micro_batches"] == count
        assert grad_rel <= RTOL_FLOAT64, (budget, grad_rel)
        assert rel(gs["loss"], ws["loss"]) <= RTOL_FLOAT64, (budget, gs["loss"], ws["loss"])
        assert rel(gs["grad_norm"], ws["grad_norm"]) <= RTOL_FLOAT64
        assert gs["tokens"] == ws["tokens"]
        assert sorted(gs) == sorted(ws)
        for key, value in ws.items():
            if key != "micro_batches" and not key.startswith("time/"):  # seconds: not a value of the step
                assert gs[key] == pytest.approx(value, rel=1e-6, abs=1e-7), (budget, key)
        diff = float((flat(got["params"]) - flat(want["params"])).abs().max())
        assert diff <= 1e-12, (budget, diff)


@pytest.mark.parametrize(
    ("estimator", "normalizer"), [("sampled", "token-mean"), ("topk", "seq-mean-token-mean")]
)
def test_micro_batches_in_float32_within_1e_6(recorded, estimator, normalizer):
    loss = loss_section(estimator, normalizer, True)
    want = one_step(recorded, loss)
    g1 = flat(want["exp_avg"])
    for budget, count in BUDGETS.items():
        got = one_step(recorded, loss, micro_batch_tokens=budget)
        assert got["stats"]["micro_batches"] == count
        grad_rel = float((flat(got["exp_avg"]) - g1).norm() / g1.norm())
        assert grad_rel <= RTOL_FLOAT32, (budget, grad_rel)
        assert rel(got["stats"]["loss"], want["stats"]["loss"]) <= RTOL_FLOAT32


def saved_bytes(engine: TorchTrainEngine, batch) -> int:
    """Bytes the train forward keeps for its backward (autograd's saved tensors)."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    engine.train_module.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        engine.compute_loss(batch)
    return total


def test_activation_checkpointing_changes_nothing_but_memory(recorded):
    batch = load_record(recorded["batch"])
    kept = {}
    for on in (False, True):
        engine = TorchTrainEngine.from_pretrained(
            recorded["model"], dtype="float32", device="cpu", optimizer=OptimizerConfig(lr=1e-3),
            loss=LossConfig(), micro_batching=MicroBatching(None, on),
        )  # fmt: skip
        kept[on] = saved_bytes(engine, batch)
    # Measured 337,148 → 67,452 bytes on the 1-layer micro model (the LM head's are not recomputed).
    assert kept[True] * 4 < kept[False], kept
    loss = loss_section("sampled", "token-mean", True)
    want = one_step(recorded, loss, dtype="float64", micro_batch_tokens=32)
    got = one_step(recorded, loss, dtype="float64", micro_batch_tokens=32, activation_checkpointing=True)
    g1 = flat(want["exp_avg"])
    assert float((flat(got["exp_avg"]) - g1).norm() / g1.norm()) <= 1e-12
    assert rel(got["stats"]["loss"], want["stats"]["loss"]) <= 1e-12


def test_plan_rows_longest_first_within_the_budget():
    lengths = [7, 3, 4, 4, 8, 4, 5, 7]
    assert plan_rows(lengths, None) == [list(range(8))]
    assert plan_rows([], 10) == []
    assert plan_rows(lengths, 64) == [[4, 0, 7, 6, 2, 3, 5, 1]]  # stable: equal lengths keep their order
    assert plan_rows(lengths, 32) == [[4, 0, 7, 6], [2, 3, 5, 1]]
    assert plan_rows(lengths, 12) == [[4], [0], [7], [6, 2], [3, 5, 1]]
    # A row longer than the budget runs alone; every micro-batch's rows × longest length stays within it.
    assert plan_rows(lengths, 5) == [[4], [0], [7], [6], [2], [3], [5], [1]]
    for budget in range(8, 70):
        plan = plan_rows(lengths, budget)
        assert sorted(i for mb in plan for i in mb) == list(range(8))
        assert all(len(mb) * max(lengths[i] for i in mb) <= budget for mb in plan)


def test_split_rows_cuts_each_micro_batch_to_its_own_rows(recorded):
    batch = load_record(recorded["batch"])
    parts = split_rows(batch, 12)
    assert [p.index.tolist() for p in parts] == [[4], [0], [7], [6, 2], [3, 5, 1]]
    for part in parts:
        sub, idx = part.batch, part.index
        lengths = batch.tokens.attention_mask.sum(1)[idx]
        assert sub.tokens.input_ids.shape == (len(idx), int(lengths.max()))
        width = sub.tokens.response_width
        assert width == max(1, int(batch.tokens.response_lengths[idx].max()))
        assert torch.equal(sub.tokens.input_ids, batch.tokens.input_ids[idx, : lengths.max()])
        assert torch.equal(sub.behavior_logprobs, batch.behavior_logprobs[idx, :width])
        assert torch.equal(sub.teacher_topk["a"].indices, batch.teacher_topk["a"].indices[idx, :width])
        assert torch.equal(sub.teacher_weights["b"], batch.teacher_weights["b"][idx])
        assert torch.equal(sub.orm_advantages, batch.orm_advantages[idx])
        real = sub.tokens.response_mask
        assert torch.equal(real, batch.tokens.response_mask[idx, :width])
        assert torch.equal(sub.tokens.logit_positions[real], batch.tokens.logit_positions[idx, :width][real])
    # Row 2 has an empty response: its micro-batch still has one (masked) response position.
    assert parts[3].batch.tokens.response_mask[1].sum() == 0
    with pytest.raises(BatchError, match="select\\(length=0, width=1\\)"):
        batch.select(torch.tensor([0]), 0, 1)


def test_step_stats_sum_shares_and_weight_means_by_tokens():
    acc = StepStats()
    acc.add({"loss": torch.tensor(0.5), "mopd/tokens": torch.tensor(3.0), "mopd/rho": torch.tensor(1.0)},
            torch.tensor(3))  # fmt: skip
    acc.add({"loss": torch.tensor(-0.25), "mopd/tokens": torch.tensor(1.0), "mopd/rho": torch.tensor(2.0)},
            torch.tensor(1))  # fmt: skip
    assert acc.count == 2
    assert acc.result() == {"loss": 0.25, "mopd/tokens": 4.0, "mopd/rho": 1.25}
    with pytest.raises(MicroBatchError, match="first one's were"):
        acc.add({"loss": torch.tensor(0.0)}, torch.tensor(0))
    none = StepStats()
    none.add({"m": torch.tensor(2.0)}, torch.tensor(0))
    none.add({"m": torch.tensor(4.0)}, torch.tensor(0))
    assert none.result() == {"m": 3.0}  # no loss token anywhere: the plain mean
    assert StepStats().result() == {}
    assert is_additive("loss") and is_additive("grpo/loss") and is_additive("mopd/tokens")
    assert not is_additive("mopd/reverse_kl")


def test_fields_and_their_errors():
    actor = {"id": "a", "path": "p", "optimizer": {"lr": 1e-3}}
    cfg = ActorConfig(**actor)
    assert cfg.micro_batch_tokens is None and cfg.activation_checkpointing is False
    assert MicroBatching.from_actor(cfg) == MicroBatching()
    cfg = ActorConfig(**actor, micro_batch_tokens=8192, activation_checkpointing=True)
    assert MicroBatching.from_actor(cfg) == MicroBatching(8192, True)
    with pytest.raises(ValidationError, match="micro_batch_tokens"):
        ActorConfig(**actor, micro_batch_tokens=0)
    with pytest.raises(MicroBatchError, match="micro_batch_tokens is 0; expected an int >= 1"):
        MicroBatching(0)
    with pytest.raises(MicroBatchError, match="is True"):
        MicroBatching(True)  # type: ignore[arg-type]


def test_train_step_gives_its_activations_back_once(recorded, monkeypatch):
    """The engine's step ends with `release_activations` of its device, once (on CUDA it empties the caching
    allocator so that the children sharing the GPU have the activations' memory in the other phases; the
    memory plan counts it in `train` only), after every micro-batch: a split step releases once too."""
    import mopd_hpc.engines.micro_batch as micro_batch  # `StepStats.finish`, which both engines' steps end with

    calls: list[torch.device] = []
    monkeypatch.setattr(micro_batch, "release_activations", calls.append)
    loss = loss_section("sampled", "token-mean", False)
    for budget, count in [(None, 1), *BUDGETS.items()]:
        calls.clear()
        out = one_step(recorded, loss, micro_batch_tokens=budget)
        assert out["stats"]["micro_batches"] == count and calls == [torch.device("cpu")]
