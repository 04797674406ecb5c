"""The part of one step every rank of the actor group runs (SPMD), on its own shard of the step's rows.

Given the step record rank 0 sent (`trainer/step_record.py`) and this rank's shard (`trainer/shards.py`):

    TEACHER  this rank's rows go to the teacher servers straight from this rank (`score_teachers` on the
             shard): no rank receives, or re-sends, another DP rank's top-k targets. At TP > 1 only TP rank 0
             of the replica asks the teachers and broadcasts the scores to the other ranks of its TP group,
             which train on the same rows (`trainer/tp_share.py`): one request per replica, not per rank.
             With a KL penalty the rank's own reference model (`engines/reference.py`) scores the same rows,
             then gives its device memory back
    DRAIN    the answers now live in this rank's tensors only (its reference offloaded); its receipt (step,
             rows scored) is gathered at rank 0, which may then release the teachers (the controller's
             `on_drained`); a barrier keeps every rank from training before that release (on GPU the
             teachers' memory is the actor's to use)
    TRAIN    `engine.train_step` on the shard; the engine divides the loss sum by the token count of the
             whole step (engines/data_parallel.py), so the update is the DP = 1 update; the topk
             estimator's ratio statistics are summed over the ranks (`step.ratio_sums`)

SYNC and everything else of the step (rollout, metrics, checkpoints) is rank 0's (trainer/controller.py).

Shape legend: b rows of the shard, T response positions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mopd_hpc.config.loss import LossConfig
from mopd_hpc.engines.protocol import TrainEngine
from mopd_hpc.engines.reference import ReferenceModel
from mopd_hpc.engines.span_clock import SpanClock
from mopd_hpc.engines.teacher.replica_pool import TeacherPool
from mopd_hpc.mopd.plan import ExecutionPlan
from mopd_hpc.mopd.targets import REFUSED_LOGPROB
from mopd_hpc.trainer.group import Group, Receipts
from mopd_hpc.trainer.sft_warmup import is_sft_step
from mopd_hpc.trainer.shards import Shard, shard_rows
from mopd_hpc.trainer.step import MISMATCH_KEY, RATIO_KEYS, ratio_means, ratio_sums, shard_batch
from mopd_hpc.trainer.step_record import ControlRecord
from mopd_hpc.trainer.teacher_phase import TeacherScores, score_teachers
from mopd_hpc.trainer.tp_share import share_scores

log = logging.getLogger("mopd_hpc.trainer")
#: Metric: (row, position, teacher) entries of the step a teacher refused (−inf log-prob; mopd/targets.py).
REFUSED_KEY = "mopd/teacher_refused_tokens"


def make_resident(engine: TrainEngine, what: str) -> None:
    """Onload the actor when any of it is offloaded (AWEX colocate releases it after each publish)."""
    if not engine.residency.on_device:
        report = engine.onload()
        log.info("actor onloaded before the %s: %s", what, report.message)


@dataclass(frozen=True, slots=True)
class ShardOutcome:
    """What one rank's shard step gives: the engine's statistics (global: reduced over the ranks), the
    shard, and seconds per phase on this rank ("teacher", "drain", "train"; absent phases absent; "reference":
    the part of "teacher" the reference model took; "prepare": the part of "train" the `before_train` callback
    took, device time on CUDA, 0 without a callback)."""

    stats: Mapping[str, float]
    shard: Shard
    timings: Mapping[str, float]


class ShardStep:
    """One rank's TEACHER → DRAIN → TRAIN of a step (module docstring).

    Args:
        engine: the actor's train engine (its DDP group is the actor group's data-parallel ranks).
        teachers: teacher id → client of its server, opened by the caller.
        plan: the run's ExecutionPlan. loss: the loss section (its top-k and correction).
        route_weights: route → {teacher id: w_j}. group: the actor group.
        reference: this rank's reference model, exactly when the plan needs one (`requires_reference`).
        steps: the run's `steps` (the length of a `loss.sft_warmup_ratio` warm-up); None only without one.

    Raises:
        ValueError: a reference given to a plan without a KL penalty, or none to a plan with one; a
            `loss.sft_warmup_ratio` without `steps`.
    """

    def __init__(
        self,
        engine: TrainEngine,
        teachers: Mapping[str, TeacherPool],
        plan: ExecutionPlan,
        loss: LossConfig,
        route_weights: Mapping[str, Mapping[str, float]],
        group: Group,
        reference: ReferenceModel | None = None,
        *,
        steps: int | None = None,
    ) -> None:
        if plan.requires_reference != (reference is not None):
            raise ValueError(
                f"plan.requires_reference is {plan.requires_reference} (loss.kl_coefficient="
                f"{loss.kl_coefficient}, rl_coefficient={loss.rl_coefficient}) but the reference model is "
                f"{'given' if reference is not None else 'None'}; build it exactly when the KL penalty is on"
            )
        self.engine, self.teachers, self.plan, self.loss = engine, teachers, plan, loss
        self.route_weights, self.group, self.reference = route_weights, group, reference
        loss.sft_steps(steps)  # ValueError now, not at step 1: a warm-up ratio needs the run's steps
        self.steps = steps

    def shard_of(self, record: ControlRecord) -> Shard:
        """This rank's rows of the step (`shard_rows`, the same on every rank)."""
        return shard_rows(record.response_lengths, self.group.dp_size)[self.group.dp_rank]

    async def run(
        self,
        record: ControlRecord,
        on_drained: Callable[[Receipts], Awaitable[None]] | None = None,
        before_train: Callable[[], None] | None = None,
    ) -> ShardOutcome:
        """TEACHER, DRAIN, TRAIN of `record` on this rank's shard.

        on_drained: rank 0's release of the teachers, given every rank's receipt (called between the gather
            and the barrier). before_train: called just before `train_step` (rank 0: onload the actor).

        Raises:
            TeacherPhaseError / TeacherClientError: a teacher's answer or server failed.
            PeerLostError: another rank failed during a collective.
        """
        shard = self.shard_of(record)
        timings: dict[str, float] = {}
        scores = ref_logprobs = None
        # an SFT warm-up step's loss reads no teacher score and no reference log-prob (`mopd/sft.py`): the phase
        # runs (the drain releases the teachers) without scoring; every rank skips alike (a function of the step)
        scoring = not is_sft_step(record.step, self.loss, self.steps)
        if self.plan.scores_before_train:
            t0 = time.perf_counter()
            if self.plan.requires_teacher_scoring and scoring:
                scores = await self.score(record, shard) if self.group.tp_rank == 0 else None
                if self.group.tp_size > 1:
                    scores = share_scores(scores, list(self.teachers), self.group, record.step)
            if self.reference is not None and scoring:
                ref_logprobs = self.reference.logprobs(record.tokens(shard.start, shard.stop))
                timings["reference"] = self.reference.last_seconds
            timings["teacher"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            receipts = self.group.gather_receipts(record.step, shard.rows)
            if on_drained is not None and receipts is not None:
                await on_drained(receipts)
            self.group.barrier(f"after the drain of step {record.step}")
            timings["drain"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        timings["prepare"] = 0.0
        if before_train is not None:
            # queued work before the callback is the drain's, not the onload's: the clock waits for it first
            clock = SpanClock(getattr(self.engine, "device", None))  # a test's fake engine may have none
            clock.start()
            before_train()
            timings["prepare"] = clock.lap("prepare")
        stats = self.train(record, shard, scores, ref_logprobs)
        timings["train"] = time.perf_counter() - t0
        return ShardOutcome(stats, shard, timings)

    async def score(self, record: ControlRecord, shard: Shard) -> TeacherScores:
        """TEACHER: this rank's rows scored by the teachers of their routes."""
        lo, hi = shard.start, shard.stop
        scores = await score_teachers(
            self.teachers,
            record.rows[lo:hi],
            record.starts[lo:hi],
            record.tokens(lo, hi),
            record.routes[lo:hi],
            self.route_weights,
            top_k=self.loss.topk if self.plan.estimator == "topk" else None,
        )
        if scores.targets.refused_tokens:
            log.warning(
                "step %d, rows %d..%d: %d teacher log-prob(s) were -inf (the teacher refuses the sampled "
                "token): taken as %.2f (mopd/targets.py REFUSED_LOGPROB)",
                record.step,
                lo,
                hi - 1,
                scores.targets.refused_tokens,
                REFUSED_LOGPROB,
            )
        return scores

    def train(
        self,
        record: ControlRecord,
        shard: Shard,
        scores: TeacherScores | None,
        ref_logprobs: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """TRAIN: one `train_step` on the shard (`ref_logprobs`: the reference's [b, T] log-probs of its rows);
        the ratio statistics of the topk estimator summed over the data-parallel ranks (every rank takes part
        in that all-reduce)."""
        batch = shard_batch(
            record, shard, scores, ref_logprobs, is_sft_step(record.step, self.loss, self.steps)
        )
        seen: dict[str, Any] = {}
        topk = self.plan.estimator == "topk" and self.plan.requires_teacher_scoring

        # ρ statistics (topk) and |log π_θ − log μ| from the train step's own log π_θ (no second forward pass)
        def observe(logprobs: torch.Tensor) -> dict[str, float]:
            if not batch.sft:  # an SFT warm-up step's rows are the teachers' answers: no μ, no ratio
                seen["sums"] = ratio_sums(logprobs, batch, self.loss)
            return {}

        stats = dict(self.engine.train_step(batch, observe=observe))
        self.group.forget_read_records()  # the gradient all-reduce: every rank has read this record
        if scores is not None:  # teachers' refusals (−inf log-probs, mopd/targets.py) of the whole step
            (stats[REFUSED_KEY],) = self.group.all_reduce_sum([scores.targets.refused_tokens])
        if "sums" in seen:
            sums = seen["sums"]
            # the sampled estimator's loss reports its own ρ statistics: the mismatch only is added
            keys = [k for k in RATIO_KEYS if k in sums and (topk or k == MISMATCH_KEY)]
            flat = self.group.all_reduce_sum([x for k in keys for x in sums[k]])
            stats |= ratio_means({k: (flat[2 * i], flat[2 * i + 1]) for i, k in enumerate(keys)})
        return stats
