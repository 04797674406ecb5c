"""Enumeration oracle for the MOPD loss (float64, tabular policy, exact expectations, 1e-10).

The policy is a table of logits, one row per prefix (all prefixes up to length T − 1 over a vocabulary
of V tokens). Every sequence y ∈ V^T is enumerated and weighted by its exact probability, so
E_y[∇L(y)] is computed without sampling and compared with the gradient of the per-token reverse KL with
the prefix distribution held fixed (DESIGN.md §3):

    E_{y~π_θ} ∇L_MOPD(y) = ∇_θ Σ_t E_{s_t~sg(π_θ)} [Σ_j w_j·KL(π_θ(·|s_t) ‖ π_j(·|s_t))] / normalizer
"""

from __future__ import annotations

import itertools

import pytest
import torch

from mopd_hpc.config.loss import LossConfig
from mopd_hpc.mopd.loss import mopd_loss
from mopd_hpc.mopd.targets import aggregate_teacher_targets

F64 = torch.float64
TOL = 1e-10


class Tabular:
    """A tabular autoregressive policy: logits[row(prefix)] for every prefix of length < T."""

    def __init__(self, vocab: int, length: int, seed: int, scale: float = 1.5) -> None:
        self.vocab, self.length = vocab, length
        self.prefixes = [p for t in range(length) for p in itertools.product(range(vocab), repeat=t)]
        self.row = {p: i for i, p in enumerate(self.prefixes)}
        gen = torch.Generator().manual_seed(seed)
        self.logits = scale * torch.randn(len(self.prefixes), vocab, generator=gen, dtype=torch.float64)

    def logp_table(self, logits: torch.Tensor | None = None) -> torch.Tensor:
        return torch.log_softmax(self.logits if logits is None else logits, dim=-1)

    def sequence_logprobs(self, y: tuple[int, ...], table: torch.Tensor) -> torch.Tensor:
        """[T] log π(y_t | y_<t) read from a [n_prefixes, V] log-prob table."""
        return torch.stack([table[self.row[y[:t]], y[t]] for t in range(self.length)])

    def prefix_probs(self, table: torch.Tensor) -> torch.Tensor:
        """[n_prefixes] probability of each prefix under the table (detached)."""
        table = table.detach()
        out = torch.empty(len(self.prefixes), dtype=F64)
        for i, p in enumerate(self.prefixes):
            out[i] = torch.exp(
                sum((table[self.row[p[:t]], p[t]] for t in range(len(p))), torch.tensor(0.0, dtype=F64))
            )
        return out


def expected_surrogate_grad(
    student: Tabular,
    teachers: dict[str, Tabular],
    weights: dict[str, float],
    config: LossConfig,
    *,
    sampler: Tabular | None = None,
    mask_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ_y P_μ(y)·∇L(y), Σ_y P_μ(y)·reverse_kl_stat(y)), μ = sampler (default: the student itself)."""
    theta = student.logits.clone().requires_grad_(True)
    table = student.logp_table(theta)
    behavior_table = (sampler or student).logp_table().detach()
    teacher_tables = {tid: t.logp_table() for tid, t in teachers.items()}
    total = torch.zeros((), dtype=F64)
    kl_stat = torch.zeros((), dtype=F64)
    mask = torch.ones(1, student.length, dtype=torch.bool)
    if mask_first:
        mask[0, 0] = False
    for y in itertools.product(range(student.vocab), repeat=student.length):
        lp = student.sequence_logprobs(y, table)[None]
        mu = student.sequence_logprobs(y, behavior_table)[None].clone()
        prob = torch.exp(mu.sum())
        targets = aggregate_teacher_targets(
            {tid: student.sequence_logprobs(y, t)[None] for tid, t in teacher_tables.items()}, [weights]
        )
        s64 = sum(w * student.sequence_logprobs(y, teacher_tables[tid])[None] for tid, w in weights.items())
        w64 = torch.full_like(lp, float(sum(weights.values())))
        loss, stats = mopd_loss(lp, mu, s64, w64, mask, config)
        assert torch.allclose(targets.logp_sum.double(), s64, atol=1e-5)  # float32 aggregation agrees
        total = total + prob * loss
        kl_stat = kl_stat + prob * stats["mopd/reverse_kl"].double()
    (grad,) = torch.autograd.grad(total, theta)
    return grad, kl_stat


def exact_reverse_kl_grad(
    student: Tabular,
    teachers: dict[str, Tabular],
    weights: dict[str, float],
    *,
    sampler: Tabular | None = None,
    mask_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(∇ Σ_t E_{s_t~sg(μ)} Σ_j w_j KL(π_θ(·|s_t) ‖ π_j(·|s_t)) / N, the value of that objective)."""
    theta = student.logits.clone().requires_grad_(True)
    logp = student.logp_table(theta)
    prefix_p = student.prefix_probs((sampler or student).logp_table())
    objective = torch.zeros((), dtype=F64)
    count = 0
    for t in range(student.length):
        if mask_first and t == 0:
            continue
        count += 1
        for p in itertools.product(range(student.vocab), repeat=t):
            r = student.row[p]
            for tid, w in weights.items():
                q = teachers[tid].logp_table()[r]
                objective = objective + prefix_p[r] * w * (logp[r].exp() * (logp[r] - q)).sum()
    objective = objective / count
    (grad,) = torch.autograd.grad(objective, theta)
    return grad, objective.detach()


CASES = {
    "one_teacher_T1": (8, 1, {"a": 1.0}),
    "one_teacher_T3": (4, 3, {"a": 1.0}),
    "two_teachers": (4, 3, {"a": 0.5, "b": 0.5}),
    "unnormalized_weights": (5, 2, {"a": 0.7, "b": 2.3}),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("correction", ["none", "truncate"])
@pytest.mark.parametrize("normalizer", ["token-mean", "seq-mean-token-mean"])
def test_expected_gradient_equals_reverse_kl_gradient(case: str, correction: str, normalizer: str) -> None:
    vocab, length, weights = CASES[case]
    student = Tabular(vocab, length, seed=1)
    teachers = {tid: Tabular(vocab, length, seed=10 + i) for i, tid in enumerate(sorted(weights))}
    config = LossConfig(correction=correction, normalizer=normalizer)
    got, kl_stat = expected_surrogate_grad(student, teachers, weights, config)
    want, objective = exact_reverse_kl_grad(student, teachers, weights)
    assert want.abs().max() > 1e-3  # a non-trivial gradient
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)
    # The k1 statistic is an unbiased per-token estimate of Σ_j w_j·KL: its expectation is the objective.
    torch.testing.assert_close(kl_stat, objective, atol=1e-6, rtol=0)


def test_t1_is_the_exact_gradient_of_weighted_kl() -> None:
    vocab, weights = 8, {"a": 0.3, "b": 1.9}
    student = Tabular(vocab, 1, seed=3)
    teachers = {"a": Tabular(vocab, 1, seed=4), "b": Tabular(vocab, 1, seed=5)}
    theta = student.logits.clone().requires_grad_(True)
    p = torch.log_softmax(theta[0], -1)
    kl = sum(w * (p.exp() * (p - teachers[t].logp_table()[0])).sum() for t, w in weights.items())
    (want,) = torch.autograd.grad(kl, theta)
    got, _ = expected_surrogate_grad(student, teachers, weights, LossConfig(correction="none"))
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)


def test_masked_first_token_changes_the_normalizer_and_the_terms() -> None:
    vocab, length, weights = 4, 3, {"a": 1.0, "b": 0.25}
    student = Tabular(vocab, length, seed=7)
    teachers = {"a": Tabular(vocab, length, seed=8), "b": Tabular(vocab, length, seed=9)}
    got, _ = expected_surrogate_grad(
        student, teachers, weights, LossConfig(correction="none"), mask_first=True
    )
    want, _ = exact_reverse_kl_grad(student, teachers, weights, mask_first=True)
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)


@pytest.mark.parametrize(
    "config",
    [
        LossConfig(correction="truncate", ratio_cap=1e6),
        LossConfig(correction="mask", mask_low=1e-6, mask_high=1e6),
    ],
    ids=["truncate_uncapped", "mask_wide"],
)
def test_off_policy_correction_recovers_the_per_token_gradient(config: LossConfig) -> None:
    """Sampling from μ ≠ π_θ: ρ_t = π_θ/μ makes each token's term exact; prefixes follow μ."""
    vocab, length, weights = 4, 2, {"a": 1.0, "b": 0.5}
    student = Tabular(vocab, length, seed=11, scale=1.0)
    sampler = Tabular(vocab, length, seed=12, scale=1.0)
    teachers = {"a": Tabular(vocab, length, seed=13), "b": Tabular(vocab, length, seed=14)}
    got, _ = expected_surrogate_grad(student, teachers, weights, config, sampler=sampler)
    want, _ = exact_reverse_kl_grad(student, teachers, weights, sampler=sampler)
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)
    # Without the correction the same samples give a different (biased) gradient.
    biased, _ = expected_surrogate_grad(
        student, teachers, weights, LossConfig(correction="none"), sampler=sampler
    )
    assert (biased - want).abs().max() > 1e-3
