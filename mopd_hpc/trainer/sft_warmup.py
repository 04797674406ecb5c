"""The ROLLOUT of an SFT warm-up step (`loss.sft_warmup_steps`): the route teachers' greedy answers.

For steps 1..N of a run with `loss.sft_warmup_steps: N` (or `loss.sft_warmup_ratio: r`, N = round(r·steps)) the controller takes the step's prompts from the same
routed stream as any step, but the responses are the route teacher's greedy answers, generated on the
teacher's server (`TeacherPool.generate_greedy`, the evaluation's route: engines/teacher/greedy_generate.py)
instead of student samples on the rollout engines; the train step then applies the SFT cross-entropy
(`mopd/sft.py`) to them (`TrainBatch.sft`, set on every rank from the record's step: `is_sft_step`). The
route's teacher is its highest-weight one (the first listed among equals). Each answer is cut after its
first EOS and repeated samples_per_prompt times (the row layout of a rollout step); μ is 0 (not read). The
teachers score none of the step's rows (its loss reads no teacher log-prob; `trainer/rank_step.py`).

Shape legend: B = prompts · samples_per_prompt rows, T response positions.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mopd_hpc.config.loss import LossConfig
from mopd_hpc.data import is_correct
from mopd_hpc.engines.batch import TokenBatch
from mopd_hpc.trainer.evaluate import GreedyFn
from mopd_hpc.trainer.rollout_phase import RolloutPhaseError, Rollouts, encode_prompts


def is_sft_step(step: int, loss: LossConfig, steps: int | None) -> bool:
    """Whether step `step` (1-based) is an SFT warm-up step: step ≤ `loss.sft_steps(steps)` (sft_warmup_steps,
    or round(sft_warmup_ratio · steps)); `steps` is the run's, None only where the ratio is unset."""
    return step <= loss.sft_steps(steps)


def route_teacher(weights: Mapping[str, float]) -> str:
    """The teacher whose greedy answers a route's warm-up trains on: the highest weight, first among equals."""
    return max(weights, key=lambda t: weights[t])  # max keeps the first of equal keys


def cut_after_eos(row: Sequence[int], eos: int) -> list[int]:
    """A greedy row's tokens up to and including its first EOS (all of them when there is none)."""
    row = [int(t) for t in row]
    return row[: row.index(eos) + 1] if eos in row else row


async def teacher_rollouts(
    cfg: Any, data: Any, generators: Mapping[str, GreedyFn], tokenizer: Any, pad_id: int
) -> Rollouts:
    """An SFT warm-up step's rows: data.batch_size prompts from `data.dataset` (the stream advances as in any
    step), each answered greedily by its route's teacher (`generators`: teacher id → its server's greedy
    route) within rollout.sampling.max_new_tokens, repeated data.samples_per_prompt times; rewards by the
    sources' scorers (monitoring), μ = 0.

    Raises:
        RolloutPhaseError: a prompt too long, or every answer empty.
    """
    draws = data.dataset.take(cfg.data.batch_size)
    prompt_ids = encode_prompts(tokenizer, draws, cfg.data.max_prompt_tokens)
    eos, max_new = tokenizer.eos_token_id, cfg.rollout.sampling.max_new_tokens
    answers: list[list[int]] = [[] for _ in draws]
    by_teacher: dict[str, list[int]] = {}
    for i, d in enumerate(draws):
        by_teacher.setdefault(route_teacher(cfg.routes[d.route]), []).append(i)
    # every teacher answers its rows at once (each on its own server, as the TEACHER phase scores them)
    outs = await asyncio.gather(
        *(
            generators[t]([prompt_ids[i] for i in rows], max_new, eos, pad_id)
            for t, rows in by_teacher.items()
        )
    )
    for rows, out in zip(by_teacher.values(), outs, strict=True):
        for i, row in zip(rows, out, strict=True):
            answers[i] = cut_after_eos(row, eos)
    if not any(answers):
        raise RolloutPhaseError(
            "an SFT warm-up step whose teacher answers are all empty: no token to train on"
        )
    n = cfg.data.samples_per_prompt
    order = [i for i in range(len(draws)) for _ in range(n)]
    tokens = TokenBatch.from_samples([prompt_ids[i] for i in order], [answers[i] for i in order], pad_id)
    completions = tuple(tokenizer.decode(answers[i], skip_special_tokens=True) for i in order)
    rewards = [
        float(data.sources[draws[i].source].score(draws[i].sample, c))
        for i, c in zip(order, completions, strict=True)
    ]
    return Rollouts(
        draws=tuple(draws[i] for i in order),
        rows=tuple(tuple(prompt_ids[i]) + tuple(answers[i]) for i in order),
        starts=tuple(len(prompt_ids[i]) for i in order),
        tokens=tokens,
        behavior_logprobs=torch.zeros(tokens.response_mask.shape, dtype=torch.float32),
        rewards=torch.tensor(rewards, dtype=torch.float32),
        correct=torch.tensor([is_correct(r) for r in rewards], dtype=torch.bool),
        completions=completions,
        weight_versions=("teacher",) * len(order),
    )
