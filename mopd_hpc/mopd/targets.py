"""Teacher targets: aggregate each teacher's log-probs of the sampled tokens into S and W.

Per token t of sample b routed to route r(b) with teacher weights {j: w_j}:

    S[b, t] = Σ_j w_j · log π_j(y_t | s_t)        (weighted teacher log-prob sum)
    W[b, t] = Σ_j w_j                             (weight sum, constant along t)

so that S − W·log π_θ(y_t) = Σ_j w_j·(log π_j − log π_θ): minimizing Σ_j w_j·KL(π_θ ‖ π_j) targets the
geometric teacher ensemble ∝ Π_j π_j^{w_j/W} (AReaL feature/mopd `aggregate_mopd_targets`; DESIGN.md §3).
Weights are not normalized. One teacher per route (MiMo-V2-Flash §4.4) is the special case.

A teacher's refusal (a −inf log-prob: the teacher gives the sampled token probability 0, e.g. a vocabulary
entry its head masks; it arrives as the wire's floor −1e30, engines/teacher/score_frames.py) is taken as the
smallest log-prob a float32 softmax represents, `REFUSED_LOGPROB` = log(float32 tiny) ≈ −87.34 nats, and
counted (`TeacherTargets.refused_tokens`). Why a finite floor rather than an error or a mask: the refusal is
information (reverse KL(π_θ ‖ π_j) is +∞ there: the student must stop emitting that token), so the token
keeps a large negative advantage A = S − W·log π_θ ≥ W·(−87.34) − W·log π_θ; kept at −1e30 it would be
an advantage of ~1e30 (loss and gradient ~1e30, whatever `grad_clip` then does); masked, the student would
never learn to stop. `loss.advantage_clip` clips it further when set. A NaN teacher log-prob is no refusal
but a broken forward: the teacher server refuses to answer it (engines/teacher/http_app.py).

Shape legend: B sequences, T response positions, J teachers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

#: What a teacher's −inf (or the wire's −1e30 floor) becomes in S: log of float32's smallest normal number.
REFUSED_LOGPROB = math.log(torch.finfo(torch.float32).tiny)


class TargetError(ValueError):
    """Teacher log-probs or route weights are inconsistent (shape, unknown teacher, bad weight)."""


@dataclass(frozen=True, slots=True)
class TeacherTargets:
    """Aggregated teacher targets, both float32 [B, T] on the teacher log-probs' device.

    `logp_sum` is S = Σ_j w_j·log π_j(y_t); `weight_sum` is W = Σ_j w_j (per token, constant along T).
    Positions where a sample's positive-weight teachers gave non-finite values stay non-finite in S:
    `mopd_loss` ignores them only where `loss_mask` is 0. A −inf (refused) log-prob is no such value: it enters
    S as `REFUSED_LOGPROB` (module docstring); `refused_tokens` counts those (row, position, teacher) entries
    (positions holding NaN, e.g. padding, are not counted).
    """

    logp_sum: torch.Tensor
    weight_sum: torch.Tensor
    refused_tokens: int = 0


def validate_route_weights(route: str, weights: Mapping[str, float]) -> None:
    """Raise `TargetError` unless every w_j is finite and ≥ 0 and at least one is > 0."""
    for teacher_id, w in weights.items():
        if not math.isfinite(w) or w < 0:
            raise TargetError(
                f"route {route!r}: weight of teacher {teacher_id!r} is {w}; expected finite >= 0"
            )
    if not any(w > 0 for w in weights.values()):
        raise TargetError(f"route {route!r}: teacher weights {dict(weights)} are all 0; expected one > 0")


def aggregate_teacher_targets(
    teacher_logprobs: Mapping[str, torch.Tensor],
    sample_weights: Sequence[Mapping[str, float]],
) -> TeacherTargets:
    """Build S and W from per-teacher log-probs and per-sample route weights.

    Args:
        teacher_logprobs: teacher_id → log π_j(y_t) of the sampled tokens, [B, T], any float dtype.
            Rows of samples that give teacher j weight 0 are never read (a teacher scores only the routes
            that need it; those rows may hold anything, NaN included).
        sample_weights: length B; element b is the route weights {teacher_id: w_j} of sample b.

    Returns:
        `TeacherTargets` with float32 [B, T] tensors (accumulated in float32 whatever the input dtype); a
        log-prob below `REFUSED_LOGPROB` (−inf, the wire's −1e30) of a positive-weight teacher is raised to it
        and counted in `refused_tokens`.

    Raises:
        TargetError: a weight is negative/non-finite or all zero for a sample; a teacher with positive
            weight has no log-probs; shapes differ or B does not match `len(sample_weights)`.
    """
    if not teacher_logprobs:
        raise TargetError("teacher_logprobs is empty; expected at least one teacher's [B, T] log-probs")
    shapes = {tid: tuple(lp.shape) for tid, lp in teacher_logprobs.items()}
    first_id, shape = next(iter(shapes.items()))
    for tid, s in shapes.items():
        if len(s) != 2 or s != shape:
            raise TargetError(
                f"teacher_logprobs[{tid!r}] has shape {list(s)}; expected [B, T] equal to "
                f"teacher_logprobs[{first_id!r}] {list(shape)}"
            )
    batch, _ = shape
    if len(sample_weights) != batch:
        raise TargetError(f"len(sample_weights) is {len(sample_weights)}; expected B = {batch}")
    device = next(iter(teacher_logprobs.values())).device

    weight_rows: dict[str, list[float]] = {tid: [0.0] * batch for tid in teacher_logprobs}
    for b, weights in enumerate(sample_weights):
        validate_route_weights(f"<sample {b}>", weights)
        for tid, w in weights.items():
            if w == 0:
                continue
            if tid not in weight_rows:
                raise TargetError(
                    f"sample {b} gives teacher {tid!r} weight {w} but teacher_logprobs has only "
                    f"{sorted(teacher_logprobs)}; score that teacher for this sample"
                )
            weight_rows[tid][b] = float(w)

    logp_sum = torch.zeros(shape, dtype=torch.float32, device=device)
    weight_sum = torch.zeros(batch, dtype=torch.float32, device=device)
    refused = 0
    for tid, lp in teacher_logprobs.items():
        w = torch.tensor(weight_rows[tid], dtype=torch.float32, device=device)
        used = (w > 0)[:, None]
        values = lp.detach().float()
        low = used & (values < REFUSED_LOGPROB)  # −inf and the wire's −1e30; NaN compares False
        refused += int(low.sum())
        values = torch.where(low, REFUSED_LOGPROB, values)
        contrib = torch.where(used, w[:, None] * values, 0.0)
        logp_sum = logp_sum + contrib
        weight_sum = weight_sum + w
    return TeacherTargets(
        logp_sum=logp_sum, weight_sum=weight_sum[:, None].expand(shape).contiguous(), refused_tokens=refused
    )
