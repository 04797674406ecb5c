"""A step's teacher scores shared over a tensor-parallel group: TP rank 0 asks the teachers, the others receive.

The ranks of one TP group train on the same rows (data parallelism splits the rows across DP replicas only,
trainer/shards.py). Only TP rank 0 of each replica sends its shard's rows to the teacher servers; it then
broadcasts the resulting `TeacherScores` to the other ranks of its TP group (`Group.tp_broadcast`: the TP
group's own process group, gloo on CPU, NCCL on GPU). A teacher gets one request per replica per step, not
one per rank, and every rank of the group trains on the same tensors, bit for bit (a broadcast copies).

Wire, for the J teachers of the run in the order of the step's clients (every rank knows them): first a header,
int64 [3 + 4·J],

    [b, T, refused_tokens]  then per teacher  [has_weight, has_topk, rows_scored (−1: not called), K (0: none)]

then the tensors, each as it is (no pickled objects):

    S [b, T] float32, W [b, T] float32, then per teacher in order: w [b] float32 when has_weight,
    top-k ids [b, T, K] int64 and log-probs [b, T, K] float32 when has_topk.

The receivers rebuild the mappings in the teachers' order, which is the order of the sender's (the TEACHER
phase fills them in the clients' order, trainer/teacher_phase.py).

Shape legend: b rows of the shard, T response positions, K top-k tokens, J teachers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mopd_hpc.mopd.targets import TeacherTargets
from mopd_hpc.mopd.topk import TeacherTopK
from mopd_hpc.trainer.group import Group
from mopd_hpc.trainer.teacher_phase import TeacherScores

#: Header entries before the per-teacher ones, and per teacher.
HEAD, PER_TEACHER = 3, 4
#: dtypes of the tensors on the wire (those the TEACHER phase produces).
SCORE_DTYPE, INDEX_DTYPE = torch.float32, torch.int64


def header_of(scores: TeacherScores, teachers: Sequence[str]) -> torch.Tensor:
    """int64 [3 + 4·J] header of `scores` (module docstring).

    Raises:
        ValueError: `scores` names a teacher outside `teachers`.
    """
    extra = (set(scores.weights) | set(scores.topk) | set(scores.rows_scored)) - set(teachers)
    if extra:
        raise ValueError(f"teacher scores of {sorted(extra)}, outside the run's teachers {list(teachers)}")
    b, t = scores.targets.logp_sum.shape
    values = [b, t, int(scores.targets.refused_tokens)]
    for teacher in teachers:
        topk = scores.topk.get(teacher)
        values += [
            int(teacher in scores.weights),
            int(topk is not None),
            int(scores.rows_scored.get(teacher, -1)),
            int(topk.indices.shape[-1]) if topk is not None else 0,
        ]
    return torch.tensor(values, dtype=torch.int64)


def layout_of(header: torch.Tensor, teachers: Sequence[str]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of each tensor after the header, in wire order."""
    h = header.tolist()
    b, t = h[0], h[1]
    out = [((b, t), SCORE_DTYPE), ((b, t), SCORE_DTYPE)]
    for j in range(len(teachers)):
        has_weight, has_topk, _, k = h[HEAD + PER_TEACHER * j : HEAD + PER_TEACHER * (j + 1)]
        if has_weight:
            out.append(((b,), SCORE_DTYPE))
        if has_topk:
            out += [((b, t, k), INDEX_DTYPE), ((b, t, k), SCORE_DTYPE)]
    return out


def tensors_of(scores: TeacherScores, teachers: Sequence[str]) -> list[torch.Tensor]:
    """The tensors of `scores` in wire order."""
    out = [scores.targets.logp_sum, scores.targets.weight_sum]
    for teacher in teachers:
        if teacher in scores.weights:
            out.append(scores.weights[teacher])
        if teacher in scores.topk:
            out += [scores.topk[teacher].indices, scores.topk[teacher].logprobs]
    return out


def scores_from(
    header: torch.Tensor, tensors: Sequence[torch.Tensor], teachers: Sequence[str]
) -> TeacherScores:
    """The `TeacherScores` a header and its tensors describe (the inverse of `header_of` + `tensors_of`)."""
    h = header.tolist()
    parts = iter(tensors)
    targets = TeacherTargets(logp_sum=next(parts), weight_sum=next(parts), refused_tokens=h[2])
    weights, topk, rows_scored = {}, {}, {}
    for j, teacher in enumerate(teachers):
        has_weight, has_topk, rows, _ = h[HEAD + PER_TEACHER * j : HEAD + PER_TEACHER * (j + 1)]
        if has_weight:
            weights[teacher] = next(parts)
        if has_topk:
            topk[teacher] = TeacherTopK(indices=next(parts), logprobs=next(parts))
        if rows >= 0:
            rows_scored[teacher] = rows
    return TeacherScores(targets=targets, topk=topk, weights=weights, rows_scored=rows_scored)


def share_scores(
    scores: TeacherScores | None, teachers: Sequence[str], group: Group, step: int
) -> TeacherScores:
    """TP rank 0's `scores` on every rank of its TP group (module docstring); `scores` itself at TP 1.

    Args:
        scores: at TP rank 0, its shard's scores; None at the other TP ranks.
        teachers: the run's teacher ids, in the order of the step's clients (the same on every rank).
        group: the actor group. step: the step, for messages.

    Raises:
        PeerLostError: a rank of the TP group failed during the broadcast.
        ValueError: TP rank 0 without scores, or another TP rank with some.
    """
    if group.tp_size == 1:
        if scores is None:
            raise ValueError("share_scores at TP 1 without scores: TP rank 0 scores its own shard")
        return scores
    if (scores is None) != (group.tp_rank > 0):
        raise ValueError(
            f"tp_rank={group.tp_rank} with scores {'None' if scores is None else 'given'}: TP rank 0 brings "
            "the scores, the others None"
        )
    what = f"step {step}'s teacher scores"
    if scores is not None:
        header = header_of(scores, teachers)
        group.tp_broadcast([header], f"{what} (header)")
        sent = [t.contiguous() for t in tensors_of(scores, teachers)]
        layout = layout_of(header, teachers)
        assert [(tuple(t.shape), t.dtype) for t in sent] == layout, (
            "scores do not fit the wire layout (a bug)"
        )
        group.tp_broadcast(sent, what)
        return scores
    (header,) = group.tp_broadcast([torch.empty(HEAD + PER_TEACHER * len(teachers), dtype=torch.int64)], what)
    buffers = [torch.empty(shape, dtype=dtype) for shape, dtype in layout_of(header, teachers)]
    return scores_from(header, group.tp_broadcast(buffers, what), teachers)
