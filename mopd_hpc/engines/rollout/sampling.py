"""Next-token sampling with per-row parameters and seeds, and the behavior log-probs μ(y_t).

Shape legend: B rows of the batch, V vocabulary size. All arithmetic is float32.

The behavior policy μ of a row is the exact distribution the token is drawn from:

    p      = softmax(logits / T)                                  (T = temperature)
    keep_v = (mass of tokens ranked above v under p) <= top_p     (SGLang's top-p rule; the top token
             and rank(v) < top_k                                    is always kept)
    μ      = p · keep / Σ p · keep                                (renormalized)

The token is drawn by inverse CDF with one uniform number from the row's own `torch.Generator` (the loop
decoder) or from the counter hash of `counter_rng.py` (the static decoder), so a row's tokens depend only on
its seed and its logits. The returned log-prob is log μ(y_t). Where top_p = 1 and
top_k = -1 this equals log_softmax(logits / T)(y_t), which is what SGLang 0.5.23 returns
(`output_token_logprobs` are log-probs of logits / T); with top-p/top-k SGLang reports the
pre-truncation value, this module the truncated and renormalized one (the distribution really sampled
from, which the importance ratio π_θ/μ needs).

Greedy rows (temperature < 1e-6 or top_k = 1, SGLang's rule) take the argmax (first index on ties) and
report log_softmax(logits)(y_t) at T = 1, as SGLang does (μ itself is a point mass there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mopd_hpc.engines.rollout.protocol import GREEDY_TEMPERATURE


@dataclass(frozen=True, slots=True)
class SampleOut:
    """token_ids: [B] int64; logprobs: [B] float32, log μ(token); dist_logprobs: [B, V] float32, log μ."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    dist_logprobs: torch.Tensor


def behavior_logprobs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    any_truncated: bool | None = None,
) -> torch.Tensor:
    """log μ for every token: [B, V] float32 (−inf outside the top-p/top-k support).

    Args:
        logits: [B, V], any float dtype (cast to float32).
        temperature: [B] float32; rows below 1e-6 are greedy and use T = 1, no truncation.
        top_p: [B] float32 in (0, 1].
        top_k: [B] int64, -1 = off.
        any_truncated: whether some row truncates (top_p < 1 or top_k below V, not greedy); None asks the
            tensors (one host sync). A caller that knows it from the request passes it: the values are the same.
    """
    logits = logits.float()
    greedy = (temperature < GREEDY_TEMPERATURE) | (top_k == 1)
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    logp = torch.log_softmax(logits / t[:, None], dim=-1)
    vocab = logits.shape[-1]
    k = torch.where((top_k <= 0) | greedy, torch.full_like(top_k, vocab), top_k.clamp(max=vocab))
    p = torch.where(greedy, torch.ones_like(top_p), top_p)
    truncate = (p < 1.0) | (k < vocab)
    if not (bool(truncate.any()) if any_truncated is None else any_truncated):
        return logp
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    probs = sorted_logp.exp()
    mass_before = probs.cumsum(dim=-1) - probs
    rank = torch.arange(vocab, device=logits.device)
    drop = (mass_before > p[:, None]) | (rank[None, :] >= k[:, None])
    drop[:, 0] = False
    sorted_logp = sorted_logp.masked_fill(drop, float("-inf"))
    sorted_logp = sorted_logp - torch.logsumexp(sorted_logp, dim=-1, keepdim=True)
    truncated = torch.full_like(logp, float("-inf")).scatter(-1, order, sorted_logp)
    return torch.where(truncate[:, None], truncated, logp)


def sample_next(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    generators: Sequence[torch.Generator],
) -> SampleOut:
    """Draw one token per row from μ (see the module docstring) and return it with log μ(token).

    Args:
        logits: [B, V]; temperature, top_p: [B] float32; top_k: [B] int64 (-1 = off).
        generators: B generators on the logits' device; row b draws exactly one uniform number from
            generators[b] per call, also when it is greedy (so a seed's stream never depends on T).
    """
    if len(generators) != logits.shape[0]:
        raise ValueError(f"generators: {len(generators)} given for {logits.shape[0]} rows")
    logp = behavior_logprobs(logits, temperature, top_p, top_k)
    device = logits.device
    u = torch.stack([torch.rand((), generator=g, device=device) for g in generators])
    return sample_with_uniforms(logits, logp, temperature, top_k, u)


def sample_with_uniforms(
    logits: torch.Tensor, logp: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, u: torch.Tensor
) -> SampleOut:
    """The inverse-CDF draw of `sample_next` with given uniforms: row b takes the first token whose
    cumulative μ exceeds u[b] · Σμ (greedy rows: the argmax of logits).

    Args:
        logits: [B, V]; logp: [B, V] float32, `behavior_logprobs` of the same logits; temperature: [B]
            float32; top_k: [B] int64; u: [B] float32 in [0, 1).
    """
    cdf = logp.exp().cumsum(dim=-1)
    drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1)
    drawn = drawn.clamp(max=logits.shape[-1] - 1)
    greedy = (temperature < GREEDY_TEMPERATURE) | (top_k == 1)
    tokens = torch.where(greedy, logits.float().argmax(dim=-1), drawn)
    return SampleOut(
        token_ids=tokens, logprobs=logp.gather(-1, tokens[:, None]).squeeze(-1), dist_logprobs=logp
    )
