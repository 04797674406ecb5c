"""The train engines' one call of the bound objective on a batch (`mopd.objective.Objective`).

Both train engines (torch, megatron) bind the `loss:` section once (`bind_objective`) and, per micro-batch,
call it with the student's log-probs they computed and the per-sample tensors of the `TrainBatch`
(`batch_objective`): the engine gives only what differs between backends (how log π_θ is computed), the batch
fields are passed here, in one place. An `ObjectiveError` (a loss section no engine applies, a batch that
lacks what a positive coefficient's term reads) becomes the engines' `EngineError`, its message unchanged.

Shape legend: B rows, T response positions, K top-k ids.
"""

from __future__ import annotations

import torch

from mopd_hpc.config.loss import LossConfig
from mopd_hpc.engines.batch import TrainBatch
from mopd_hpc.engines.protocol import EngineError
from mopd_hpc.mopd.loss import Stats
from mopd_hpc.mopd.objective import Objective, ObjectiveError
from mopd_hpc.mopd.topk import StudentLogprobs


def bind_objective(loss: LossConfig) -> Objective:
    """The composed loss of `loss` (`Objective(loss)`).

    Raises:
        EngineError: a loss section no engine can apply (`mopd.objective`'s refusals, same message).
    """
    try:
        return Objective(loss)
    except ObjectiveError as err:
        raise EngineError(str(err)) from None


def batch_objective(
    objective: Objective,
    batch: TrainBatch,
    logprobs: torch.Tensor,
    student_logprobs: StudentLogprobs | None,
    denominator: torch.Tensor | None,
) -> tuple[torch.Tensor, Stats]:
    """(loss, the terms' statistics) of `batch` under `objective`.

    `logprobs`: [B, T] float32 log π_θ(y_t) of the sampled tokens (carrying the gradient, 0 at padding);
    `student_logprobs`: for the top-k estimator, [B, T, K] ids → their log π_θ (None otherwise);
    `denominator`: None normalizes over `batch`, else the whole step's count (a data-parallel shard,
    a micro-batch). The mask is `batch.tokens.response_mask`.

    Raises:
        EngineError: the batch lacks what a positive coefficient's term reads.
    """
    try:
        return objective(
            logprobs=logprobs,
            behavior_logprobs=batch.behavior_logprobs,
            loss_mask=batch.tokens.response_mask,
            targets=batch.targets,
            teacher_topk=batch.teacher_topk,
            teacher_weights=batch.teacher_weights,
            student_logprobs=student_logprobs,
            orm_advantages=batch.orm_advantages,
            ref_logprobs=batch.ref_logprobs,
            denominator=denominator,
            sft=batch.sft,
        )
    except ObjectiveError as err:
        raise EngineError(str(err)) from None
