"""TEACHER: each teacher scores only the rollouts of the routes that give it weight; S and W per token.

For teacher j, the rows b with w_j(route(b)) > 0 and a non-empty response are sent to its scoring servers (a
`TeacherPool` splits them across the teacher's replicas, balanced by tokens, and answers in row order; the
teachers are called concurrently; a teacher with no such row is not called: an empty response is masked out of
the loss, and so are all the rows of a route whose responses are all empty), binary transport both ways
(`TeacherClient.score_tensors`). Every call returns log π_j(y_t) of the sampled tokens; with the `topk`
estimator it also returns the teacher's top-k (k = loss.topk) at each response position. Rows a teacher did
not score hold NaN log-probs / zero top-k, and weight 0 (`aggregate_teacher_targets` and the top-k loss never
read them). Then (DESIGN.md §3; AReaL feature/mopd `aggregate_mopd_targets`):

    S[b, t] = Σ_j w_j·log π_j(y_t)      W[b, t] = Σ_j w_j

Shape legend: B rows, T response positions, K top-k tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from mopd_hpc.engines.batch import TokenBatch
from mopd_hpc.engines.teacher.client import TeacherClient
from mopd_hpc.engines.teacher.replica_pool import TeacherPool
from mopd_hpc.engines.teacher.score_frames import ScoreTensors
from mopd_hpc.mopd.targets import REFUSED_LOGPROB, TeacherTargets, aggregate_teacher_targets
from mopd_hpc.mopd.topk import TeacherTopK


class TeacherPhaseError(ValueError):
    """A teacher's answer does not fit the batch (row count, response lengths); names the teacher."""


@dataclass(frozen=True, slots=True)
class TeacherScores:
    """The TEACHER phase's output.

    Attributes:
        targets: S, W [B, T] float32.
        topk: teacher id → `TeacherTopK` [B, T, K] (estimator topk only; else empty).
        weights: teacher id → [B] float32 w_j of each row (0 where the teacher did not score).
        rows_scored: teacher id → number of rows it scored.

    `targets.refused_tokens` counts the teachers' −inf log-probs (refusals, mopd/targets.py).
    """

    targets: TeacherTargets
    topk: Mapping[str, TeacherTopK]
    weights: Mapping[str, torch.Tensor]
    rows_scored: Mapping[str, int]


def rows_per_teacher(
    routes: Sequence[str], route_weights: Mapping[str, Mapping[str, float]], teachers: Sequence[str]
) -> dict[str, list[int]]:
    """teacher id → rows whose route gives it a positive weight (teachers with none are absent)."""
    out: dict[str, list[int]] = {}
    for teacher in teachers:
        rows = [b for b, r in enumerate(routes) if route_weights[r].get(teacher, 0.0) > 0]
        if rows:
            out[teacher] = rows
    return out


async def score_teachers(
    clients: Mapping[str, TeacherClient | TeacherPool],
    rows: Sequence[Sequence[int]],
    starts: Sequence[int],
    tokens: TokenBatch,
    routes: Sequence[str],
    route_weights: Mapping[str, Mapping[str, float]],
    *,
    top_k: int | None,
) -> TeacherScores:
    """The TEACHER phase (module docstring). top_k: k of the topk estimator, None for `sampled`.

    Raises:
        TeacherPhaseError: an answer with the wrong number of rows or response positions.
        TeacherClientError: a teacher server failed.
    """
    lengths = tokens.response_lengths.tolist()
    routed = rows_per_teacher(routes, route_weights, list(clients))
    # an empty response has nothing to score: its rows are not sent, and a teacher none of whose rows has a
    # response token is not called (its rows keep NaN log-probs and zero top-k, at masked positions only)
    sent = {t: kept for t, idx in routed.items() if (kept := [b for b in idx if lengths[b]])}
    missing = {t for r in set(routes) for t, w in route_weights[r].items() if w > 0} - set(clients)
    if missing:
        raise TeacherPhaseError(
            f"routes {sorted(set(routes))} need teachers {sorted(missing)}: not connected"
        )
    calls = [
        clients[t].score_tensors([rows[b] for b in idx], [starts[b] for b in idx], top_k)
        for t, idx in sent.items()
    ]
    answers = dict(zip(sent, await asyncio.gather(*calls), strict=True))
    batch, width = tokens.batch_size, tokens.response_width
    logprobs: dict[str, torch.Tensor] = {}
    topk: dict[str, TeacherTopK] = {}
    weights: dict[str, torch.Tensor] = {}
    for teacher, idx in routed.items():
        answer = answers.get(teacher)
        lp = torch.full((batch, width), float("nan"), dtype=torch.float32)
        at = torch.tensor(sent.get(teacher, []), dtype=torch.int64)
        if answer is not None:
            _check(teacher, answer, sent[teacher], lengths)
            lp[at] = answer.padded_logprobs(width)
        logprobs[teacher] = lp
        w = torch.zeros(batch, dtype=torch.float32)
        for b in idx:
            w[b] = float(route_weights[routes[b]][teacher])
        weights[teacher] = w
        if top_k is not None and answer is not None:
            topk[teacher] = _topk_tensor(teacher, answer, at, batch, width)
        elif top_k is not None:
            zeros = torch.zeros((batch, width, top_k), dtype=torch.int64)
            topk[teacher] = TeacherTopK(indices=zeros, logprobs=zeros.float())
    sample_weights = [{t: float(w) for t, w in route_weights[r].items() if w > 0} for r in routes]
    targets = aggregate_teacher_targets(logprobs, sample_weights)
    return TeacherScores(
        targets=targets,
        topk=topk,
        weights=weights,
        rows_scored={t: len(idx) for t, idx in sent.items()},
    )


def _check(teacher: str, answer: ScoreTensors, idx: Sequence[int], lengths: Sequence[int]) -> None:
    got = answer.lengths.tolist()
    if len(got) != len(idx):
        raise TeacherPhaseError(f"teacher {teacher!r} answered {len(got)} rows; sent {len(idx)}")
    for k, b in enumerate(idx):
        if got[k] != lengths[b]:
            raise TeacherPhaseError(
                f"teacher {teacher!r}: row {b} has {got[k]} log-probs; expected {lengths[b]}"
            )


def _topk_tensor(teacher: str, answer: ScoreTensors, at: torch.Tensor, batch: int, width: int) -> TeacherTopK:
    """[batch, width, K] top-k of the rows `at` (zeros elsewhere and after each row's end)."""
    if answer.topk_ids is None or answer.topk_logprobs is None:
        raise TeacherPhaseError(f"teacher {teacher!r} returned no top-k; the topk estimator asked for it")
    part_ids, part_vals = answer.padded_topk(width)
    k = part_ids.shape[-1]
    ids = torch.zeros((batch, width, k), dtype=torch.int64)
    vals = torch.zeros((batch, width, k), dtype=torch.float32)
    ids[at], vals[at] = part_ids, part_vals
    # a −inf among the top-k (k beyond the tokens the teacher allows; sent as −1e30) is a refusal too: the
    # same floor as the sampled log-probs' (mopd/targets.py), so q = exp(floor) and p·(log p − log q) is bounded
    return TeacherTopK(indices=ids, logprobs=vals.clamp(min=REFUSED_LOGPROB))
