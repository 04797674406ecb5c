"""Data parallelism inside the torch train engine: DP = 2 computes the DP = 1 update.

Two spawned processes form one real gloo group (FileStore rendezvous) and are reused by every case. On one
recorded batch (8 rows, one with an empty response, two teachers, an off-policy μ), each case runs one train
step at DP = 1 in this process (the oracle: the engine on the whole batch, no torch.distributed) and at DP = 2
with each rank on a contiguous shard — an even split, an uneven one, and one rank with no rows — for both
estimators, both normalizers, with and without an RL term. Asserted: the reported loss, token count, grad
norm and every statistic equal DP = 1's; the gradient (AdamW's first exp_avg = (1 − β1)·g, no clipping)
within relative norm 1e-6; both replicas' parameters identical after the step and equal to DP = 1's.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers_dp import LR, OUTPUTS, PROMPTS, WorkerGroup, record_step, run_case

from mopd_hpc.config.loss import LossConfig
from mopd_hpc.config.models import OptimizerConfig
from mopd_hpc.engines.data_parallel import DataParallel, DataParallelError
from mopd_hpc.engines.torch.engine import TorchTrainEngine
from mopd_hpc.engines.torch.scoring import TorchScoringEngine

SPLITS = [((0, 4), (4, 8)), ((0, 3), (3, 8)), ((0, 0), (0, 8))]
GRAD_RTOL = 1e-6
LOSS_RTOL = 1e-6
#: Measured max |Δθ| between DP = 2 and DP = 1 after one AdamW step (lr 1e-3): <= 8e-8 (gradients within
#: 1.1e-7 relative). Adam's update g/(|g| + ε) amplifies the rounding of a near-zero gradient element, so the
#: bound is on the parameters' absolute change, still far below lr.
PARAM_ATOL = 1e-6


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict[str, Path]:
    """The student checkpoint and one recorded step's batch (plain tensors on disk)."""
    return record_step(tmp_path_factory.mktemp("dp"))


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    group = WorkerGroup(2, tmp_path_factory.mktemp("gloo"))
    yield group
    group.close()


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def flat(named: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([named[n].double().flatten() for n in sorted(named)])


def params_before(recorded) -> dict[str, torch.Tensor]:
    model = TorchScoringEngine.from_pretrained(recorded["model"]).model
    return {n: p.detach() for n, p in model.named_parameters()}


CASES = [
    pytest.param(est, norm, rl, id=f"{est}-{norm}-{'rl' if rl else 'distill'}")
    for est in ("sampled", "topk")
    for norm in ("token-mean", "seq-mean-token-mean")
    for rl in (False, True)
]


@pytest.mark.parametrize(("estimator", "normalizer", "rl"), CASES)
def test_dp2_step_equals_dp1_step(workers, recorded, estimator, normalizer, rl):
    loss: dict[str, object] = {"estimator": estimator, "normalizer": normalizer, "topk": 4}
    if rl:
        loss |= {"rl_coefficient": 0.5, "kl_coefficient": 0.05}
        if estimator == "sampled":
            loss["orm_alpha"] = 0.3
    case = {"model": str(recorded["model"]), "batch": str(recorded["batch"]), "loss": loss}
    want = run_case(DataParallel.single(), case | {"bounds": [(0, len(PROMPTS))]})
    ws, g1 = want["stats"], flat(want["exp_avg"])
    assert g1.norm() > 0 and abs(ws["loss"]) > 1e-4
    if rl:
        assert ws["grpo/loss"] != 0
    for split in SPLITS:
        ranks = workers.run(case | {"bounds": list(split)})
        for got in ranks:
            gs = got["stats"]
            grad_rel = float((flat(got["exp_avg"]) - g1).norm() / g1.norm())
            param_diff = float((flat(got["params"]) - flat(want["params"])).abs().max())
            print(f"{estimator} {normalizer} rl={rl} split={split}: grad rel {grad_rel:.2e}, "
                  f"loss rel {rel(gs['loss'], ws['loss']):.2e}, max |dtheta| {param_diff:.2e}")  # fmt: skip
            assert grad_rel <= GRAD_RTOL, (split, grad_rel)
            assert rel(gs["loss"], ws["loss"]) <= LOSS_RTOL, (split, gs["loss"], ws["loss"])
            assert rel(gs["grad_norm"], ws["grad_norm"]) <= GRAD_RTOL
            assert gs["tokens"] == ws["tokens"] == float(sum(len(o) for o in OUTPUTS))
            assert sorted(gs) == sorted(ws)
            for key, value in ws.items():
                if key.startswith("time/"):  # seconds: this rank's own (train_step's docstring)
                    continue
                assert gs[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (split, key)
            assert param_diff <= PARAM_ATOL, (split, param_diff)
        # The replicas stay identical: same synced gradient, same AdamW step on every rank.
        for name, p in ranks[0]["params"].items():
            assert torch.equal(p, ranks[1]["params"][name]), name
    # The step moved the weights (by up to lr per element, AdamW's first step).
    moved = float((flat(want["params"]) - flat(params_before(recorded))).abs().max())
    assert 0 < moved <= 1.01 * LR


def test_ranks_that_disagree_on_statistics_all_raise(workers):
    messages = workers.run({"kind": "keys"})
    assert all("differ in their names" in m for m in messages), messages
    assert "rank 0 of 2" in messages[0] and "rank 1 of 2" in messages[1]


def test_data_parallel_record_and_its_errors(recorded):
    assert DataParallel.single() == DataParallel(0, 1, None) and not DataParallel.single().distributed
    with pytest.raises(DataParallelError, match="rank is 2 with size 2; expected 0 <= rank < 2"):
        DataParallel(2, 2)
    with pytest.raises(DataParallelError, match="size is 0; expected >= 1"):
        DataParallel(0, 0)
    with pytest.raises(DataParallelError, match="rank is True; expected an int"):
        DataParallel(True, 2)  # type: ignore[arg-type]
    with pytest.raises(DataParallelError, match="not initialized; init_process_group before"):
        DataParallel.from_group()
    single = DataParallel.single()
    assert single.all_reduce_stats({"m": 0.5}, {"loss": 2.0}, 3.0) == {"m": 0.5, "loss": 2.0}
    assert torch.equal(single.all_reduce_sum(torch.tensor([1, 2])), torch.tensor([1, 2]))
    with pytest.raises(DataParallelError, match=r"\['loss'\] are both means and sums"):
        single.all_reduce_stats({"loss": 1.0}, {"loss": 2.0}, 1.0)
    with pytest.raises(DataParallelError, match="size=2\\) but torch.distributed is not initialized"):
        TorchTrainEngine.from_pretrained(
            recorded["model"],
            dtype="float32",
            device="cpu",
            optimizer=OptimizerConfig(lr=LR),
            loss=LossConfig(),
            data_parallel=DataParallel(1, 2),
        )


def test_an_empty_shard_at_dp1_is_a_zero_loss_step(recorded):
    """B = 0 runs the stand-in row: loss 0, no tokens, a zero gradient (AdamW's first step then moves
    nothing but weight decay)."""
    from helpers_dp import load_record

    batch = load_record(recorded["batch"])
    stand_in = batch.stand_in()
    assert stand_in.batch_size == 1 and not stand_in.tokens.response_mask.any()
    assert set(stand_in.teacher_topk) == {"a", "b"} and stand_in.ref_logprobs is not None
    engine = TorchTrainEngine.from_pretrained(
        recorded["model"], dtype="float32", device="cpu", optimizer=OptimizerConfig(lr=LR), loss=LossConfig()
    )
    stats = engine.train_step(batch.rows(3, 3))
    assert stats["loss"] == 0.0 and stats["tokens"] == 0.0 and stats["grad_norm"] == 0.0
    assert not math.isnan(stats["mopd/reverse_kl"])


#: (rank bounds, micro_batch_tokens, micro-batches per rank): an even split at 2 micro-batches per rank, and
#: an empty rank (its one stand-in row) beside a rank of 3 micro-batches — ranks with different counts still
#: meet in exactly one gradient all-reduce, in their last micro-batch's backward.
MICRO_SPLITS = [(((0, 4), (4, 8)), 16, (2, 2)), (((0, 0), (0, 8)), 16, (1, 3))]
#: In float64 (the float32 checkpoint cast, `helpers_dp.train_engine`): a summation order that differs between the runs is the only
#: difference left; in float32 the same comparison gives gradients within 5.7e-7 relative, the loss's
#: cancelling signs amplifying float32 rounding.
MICRO_RTOL = 1e-10


@pytest.mark.parametrize(
    ("estimator", "normalizer"), [("sampled", "token-mean"), ("topk", "seq-mean-token-mean")]
)
def test_dp2_with_micro_batches_equals_dp1_in_one_batch(workers, recorded, estimator, normalizer):
    loss: dict[str, object] = {"estimator": estimator, "normalizer": normalizer, "topk": 4}
    loss |= {"rl_coefficient": 0.5, "kl_coefficient": 0.05}
    case = {
        "model": str(recorded["model"]),
        "batch": str(recorded["batch"]),
        "loss": loss,
        "dtype": "float64",
    }
    want = run_case(DataParallel.single(), case | {"bounds": [(0, len(PROMPTS))]})
    ws, g1 = want["stats"], flat(want["exp_avg"])
    assert ws["micro_batches"] == 1
    for bounds, budget, counts in MICRO_SPLITS:
        ranks = workers.run(case | {"bounds": list(bounds), "micro_batch_tokens": budget})
        for got, count in zip(ranks, counts, strict=True):
            gs = got["stats"]
            assert gs["micro_batches"] == count, (bounds, gs["micro_batches"])
            grad_rel = float((flat(got["exp_avg"]) - g1).norm() / g1.norm())
            param_diff = float((flat(got["params"]) - flat(want["params"])).abs().max())
            print(f"{estimator} {normalizer} bounds={bounds} micro={counts}: grad rel {grad_rel:.2e}, "
                  f"loss rel {rel(gs['loss'], ws['loss']):.2e}, max |dtheta| {param_diff:.2e}")  # fmt: skip
            assert grad_rel <= MICRO_RTOL, (bounds, grad_rel)
            assert rel(gs["loss"], ws["loss"]) <= MICRO_RTOL, (bounds, gs["loss"], ws["loss"])
            assert gs["tokens"] == ws["tokens"]
            assert sorted(gs) == sorted(ws)
            for key, value in ws.items():
                # statistics in float32 (the losses' own outputs); seconds: each rank's own
                if key != "micro_batches" and not key.startswith("time/"):
                    assert gs[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (bounds, key)
            assert param_diff <= 1e-12, (bounds, param_diff)
        for name, p in ranks[0]["params"].items():
            assert torch.equal(p, ranks[1]["params"][name]), name
