"""Global normalization: `loss_denominator` counts, and shards normalized by the whole step's denominator sum
to the whole step's loss and gradient (float64, 1e-12), for `normalize` and every loss that takes a
denominator (sampled MOPD, top-k, GRPO). Oracle: the same function on the unsplit batch (denominator None)."""

from __future__ import annotations

import pytest
import torch

from mopd_hpc.config.loss import LossConfig
from mopd_hpc.mopd.grpo import grpo_policy_loss
from mopd_hpc.mopd.loss import mopd_loss
from mopd_hpc.mopd.normalize import LossInputError, loss_denominator, normalize
from mopd_hpc.mopd.topk import TeacherTopK, topk_reverse_kl_loss

F64 = torch.float64
NORMALIZERS = ("token-mean", "seq-mean-token-mean")
# Row lengths of the step: row 2 has no loss token (it is left out of the seq-mean count).
LENGTHS = [3, 5, 0, 1, 4, 2, 5]
T, V = 5, 7
# Shards: uneven, one empty, and a shard holding only the empty row.
SHARDS = [(0, 2), (2, 2), (2, 3), (3, 7)]


def step_mask() -> torch.Tensor:
    return torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]


def test_loss_denominator_counts() -> None:
    mask = step_mask()
    assert loss_denominator(mask, "token-mean").dtype == torch.int64
    assert int(loss_denominator(mask, "token-mean")) == sum(LENGTHS) == 20
    assert int(loss_denominator(mask, "seq-mean-token-mean")) == 6
    assert int(loss_denominator(mask[2:2], "token-mean")) == 0
    assert int(loss_denominator(mask[2:3], "seq-mean-token-mean")) == 0
    with pytest.raises(LossInputError, match="normalizer is 'sum'"):
        loss_denominator(mask, "sum")  # type: ignore[arg-type]
    with pytest.raises(LossInputError, match="expected \\[B, T\\] bool"):
        loss_denominator(mask.long(), "token-mean")


@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_normalize_shards_sum_to_the_step(normalizer) -> None:
    gen = torch.Generator().manual_seed(0)
    mask = step_mask()
    per_token = torch.where(mask, torch.randn(len(LENGTHS), T, generator=gen, dtype=F64), 0.0)
    full = normalize(per_token, mask, normalizer)
    total = sum(int(loss_denominator(mask[a:b], normalizer)) for a, b in SHARDS)
    assert total == int(loss_denominator(mask, normalizer))
    parts = [normalize(per_token[a:b], mask[a:b], normalizer, torch.tensor(total)) for a, b in SHARDS]
    assert float(sum(parts)) == pytest.approx(float(full), abs=1e-12, rel=0)
    assert float(parts[1]) == 0.0 and float(parts[2]) == 0.0
    # One shard holding the whole step with its own count is the default path, bit for bit.
    assert torch.equal(normalize(per_token, mask, normalizer, loss_denominator(mask, normalizer)), full)
    assert torch.equal(normalize(per_token, mask, normalizer, int(loss_denominator(mask, normalizer))), full)


def test_normalize_refuses_a_local_or_shaped_denominator() -> None:
    mask = step_mask()
    per_token = torch.zeros(len(LENGTHS), T, dtype=F64)
    with pytest.raises(LossInputError, match="denominator is 3 but this batch alone counts 20"):
        normalize(per_token, mask, "token-mean", torch.tensor(3))
    with pytest.raises(LossInputError, match="expected a 0-d count"):
        normalize(per_token, mask, "token-mean", torch.tensor([20, 20]))


def inputs(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    b = len(LENGTHS)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=F64)

    logits = rand(b, T, V)
    lp = torch.log_softmax(logits, -1)[..., 0]
    return {
        "logits": logits,
        "mu": lp + 0.3 * rand(b, T),
        "s": lp - 0.5 + 0.2 * rand(b, T),
        "w": torch.full((b, T), 1.5, dtype=F64),
        "adv": rand(b),
        "ref": lp + 0.1 * rand(b, T),
        "top_a": torch.randint(0, V, (b, T, 3), generator=gen),
        "top_b": torch.randint(0, V, (b, T, 2), generator=gen),
        "q_a": torch.log_softmax(rand(b, T, V), -1),
        "q_b": torch.log_softmax(rand(b, T, V), -1),
        "w_a": torch.tensor([1.0, 0.5, 1.0, 0.0, 2.0, 1.0, 1.0], dtype=F64),
        "w_b": torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.0], dtype=F64),
    }


def loss_of(kind: str, x: dict[str, torch.Tensor], logits: torch.Tensor, rows: slice, cfg, denominator):
    """The loss `kind` of rows `rows`, from `logits` (a leaf carrying the gradient) and the step's inputs."""
    mask = step_mask()[rows]
    lp = torch.log_softmax(logits, -1)[..., 0]
    if kind == "sampled":
        return mopd_loss(
            lp, x["mu"][rows], x["s"][rows], x["w"][rows], mask, cfg,
            orm_advantages=x["adv"][rows], denominator=denominator,
        )[0]  # fmt: skip
    if kind == "grpo":
        return grpo_policy_loss(
            lp, x["mu"][rows], x["adv"][rows], mask, cfg, ref_logprobs=x["ref"][rows], denominator=denominator
        )[0]
    tops = {
        tid: TeacherTopK(x[f"top_{tid}"][rows], x[f"q_{tid}"][rows].gather(-1, x[f"top_{tid}"][rows]))
        for tid in ("a", "b")
    }
    weights = {"a": x["w_a"][rows], "b": x["w_b"][rows]}
    return topk_reverse_kl_loss(logits, tops, weights, mask, cfg, denominator=denominator)[0]


@pytest.mark.parametrize("normalizer", NORMALIZERS)
@pytest.mark.parametrize("kind", ["sampled", "topk", "grpo"])
def test_loss_shards_sum_to_the_step_loss_and_gradient(kind, normalizer) -> None:
    x = inputs(1)
    cfg = LossConfig(
        estimator="topk" if kind == "topk" else "sampled",
        normalizer=normalizer,
        orm_alpha=0.5 if kind == "sampled" else 0.0,
        advantage_clip=1.0,
        kl_coefficient=0.1,
    )
    full_logits = x["logits"].clone().requires_grad_(True)
    full = loss_of(kind, x, full_logits, slice(None), cfg, None)
    full.backward()
    total = torch.tensor(sum(int(loss_denominator(step_mask()[a:b], normalizer)) for a, b in SHARDS))
    shard_sum, grads = 0.0, []
    for a, b in SHARDS:
        leaf = x["logits"][a:b].clone().requires_grad_(True)
        part = loss_of(kind, x, leaf, slice(a, b), cfg, total)
        part.backward()
        shard_sum += float(part.detach())
        grads.append(leaf.grad)
    assert abs(float(full.detach())) > 1e-3
    assert shard_sum == pytest.approx(float(full.detach()), abs=1e-12, rel=0)
    torch.testing.assert_close(torch.cat(grads), full_logits.grad, atol=1e-12, rtol=0)
