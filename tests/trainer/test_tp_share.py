"""The TP group's teacher-score wire (trainer/tp_share.py): the real TEACHER phase's `TeacherScores` (several
teachers, one routed to no row, one whose rows all have empty responses, top-k and sampled estimators) sent
by TP rank 0 and rebuilt at TP rank 1 equal bit for bit, mapping order included. The transport here is an
in-process loopback that checks the receiver's buffers against what was sent; the real gloo broadcast runs in
tests/trainer/test_actor_group.py (TP 2 × DP 1 and TP 2 × DP 2)."""

from __future__ import annotations

import asyncio

import actor_group_prog as prog
import pytest
import torch

from mopd_hpc.trainer.step_record import ControlRecord
from mopd_hpc.trainer.teacher_phase import score_teachers
from mopd_hpc.trainer.tp_share import share_scores

TEACHERS = ("t", "u", "v", "w")  # v: routed to no row; w: only to a row with an empty response
ROUTES = {"a": {"t": 1.0}, "b": {"t": 0.25, "u": 0.75}, "c": {"u": 1.0}, "d": {"w": 1.0}}


class Loopback:
    """Two TP ranks of one process: rank 0's `tp_broadcast` queues copies of its tensors, rank 1's takes them
    after checking that its buffers have the shapes and dtypes sent (what a real broadcast requires)."""

    tp_size = 2

    def __init__(self, tp_rank: int, wire: list) -> None:
        self.tp_rank, self.wire = tp_rank, wire

    def tp_broadcast(self, tensors, what):
        if self.tp_rank == 0:
            self.wire.append([t.clone() for t in tensors])
            return list(tensors)
        sent = self.wire.pop(0)
        assert [(t.shape, t.dtype) for t in tensors] == [(t.shape, t.dtype) for t in sent], what
        return sent


def scores(top_k: int | None):
    gen = torch.Generator().manual_seed(7)
    rows, starts = [], []
    for response in (3, 5, 0, 2, 4):
        prompt = 2
        rows.append(torch.randint(0, 30, (prompt + response,), generator=gen).tolist())
        starts.append(prompt)
    routes = ["a", "b", "d", "c", "b"]  # the row of route d has an empty response
    record = ControlRecord.from_rows(1, rows, starts, routes, -torch.rand(5, 5, generator=gen), None, 0)
    clients = {t: prog.FakeTeacher() for t in TEACHERS}
    got = asyncio.run(
        score_teachers(clients, record.rows, record.starts, record.tokens(0, 5), routes, ROUTES, top_k=top_k)
    )
    assert set(got.weights) == {"t", "u", "w"} and set(got.rows_scored) == {"t", "u"}
    return got


@pytest.mark.parametrize("top_k", [2, None], ids=["topk", "sampled"])
def test_tp_rank1_rebuilds_rank0s_scores_bit_for_bit(top_k):
    sent = scores(top_k)
    wire: list = []
    assert share_scores(sent, TEACHERS, Loopback(0, wire), step=1) is sent
    got = share_scores(None, TEACHERS, Loopback(1, wire), step=1)
    assert not wire  # the receiver took every message: the header, then the tensors
    assert prog.digest(got) == prog.digest(sent)
    assert got.targets.refused_tokens == sent.targets.refused_tokens
    assert list(got.topk) == list(sent.topk) and list(got.rows_scored) == list(sent.rows_scored)


def test_the_ranks_roles_are_checked():
    sent = scores(2)
    with pytest.raises(ValueError, match="TP rank 0 brings the scores"):
        share_scores(sent, TEACHERS, Loopback(1, []), step=1)
    with pytest.raises(ValueError, match="TP rank 0 brings the scores"):
        share_scores(None, TEACHERS, Loopback(0, []), step=1)
    with pytest.raises(ValueError, match=r"outside the run's teachers"):
        share_scores(sent, ("t", "u"), Loopback(0, []), step=1)
