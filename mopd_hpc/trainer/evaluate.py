"""Per-route evaluation of the student (greedy pass@1, sampled mean@k) and of each route's best teacher.

pass@1 (`accuracy`) = share of held-out prompts whose greedy completion (at most
`rollout.sampling.max_new_tokens` tokens) scores exactly 1 with the prompt's source's reward (`RunData.score`;
by default the dataset's own, `mopd_hpc.data.rewards.score_completion`). mean@k = the mean over prompts of the
share of k sampled completions (rollout.sampling's temperature and top_p, seeds `sampling_seed(data.eval.seed,
0, i) + j` for copy j of prompt i: the same draws at every point of a run) that score exactly 1 (the unbiased
estimate of pass@1 under sampling; Chen et al. 2021, "Evaluating Large Language Models Trained on Code", §2.1,
with c/k of its pass@k estimator at k = 1). The held-out prompts are `trainer/data_setup.eval_prompts`. Every
model generates where it is served: the actor process loads no model for the evaluation, not even a copy of
its own.

- The student: generation on the rollout engines (`student_accuracy_on_engines`: temperature 0, the rows
  spread over the engines in contiguous blocks as a rollout step's; `student_mean_at_k`: k samples per
  prompt, spread the same way), with the weights the engines hold then (the controller evaluates after a
  weight sync, `trainer/evaluator.py`). The engines' `weight_version` of every row is kept in eval.json as
  the proof of which weights answered. Greedy on the hf engine is the argmax of the same forward as
  `data.evaluation.greedy_complete`'s `model.generate(do_sample=False)`, so on the same weights and dtype
  the answers equal the in-process evaluation's (tests/engines/test_student_eval_engines.py).
- A route's `teacher` accuracy is the best over the teachers the route gives a positive weight; each teacher
  generates on its own server, once, at the start (its accuracy does not change during the run; it is kept
  in eval.json, so a resumed run does not ask again).

`run_dir/eval.json` (written atomically; `trainer/evaluator.py` adds `points` and `k`; read and printed by
`records/eval_table.py`):

    {"routes": {ROUTE: {"teacher": acc, "student_start": acc, "student_end": acc | null, "n": prompts}},
     "teachers": {ROUTE: {TEACHER_ID: acc}},
     "student_weights": {"start": VERSION | null, "end": VERSION | null},
     "k": data.eval.samples,
     "points": [{"step": s, "weight_version": VERSION, "pass@1": {ROUTE: acc}, "mean@k": {ROUTE: acc}}, ...]}

Accuracies are fractions in [0, 1]; `student_end` is null until the run ends; `mean@k` is {} when k is 0.
VERSION is the rollout engines' weight_version of the evaluated rows (str(step) after a weight sync of that
step; several versions joined by "," if the engines disagreed, which the controller reports).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mopd_hpc.atomic import atomic_write_json
from mopd_hpc.config.rollout import SamplingConfig
from mopd_hpc.data import Prompt
from mopd_hpc.data.chat import encode_prompts
from mopd_hpc.data.evaluation import evaluate_prompts
from mopd_hpc.data.rewards import is_correct, score_completion
from mopd_hpc.engines.rollout.client import RolloutClient
from mopd_hpc.engines.rollout.protocol import GeneratedSample, SamplingParams
from mopd_hpc.records.run_dir import EVAL_FILE
from mopd_hpc.trainer.rollout_phase import engine_blocks, generate, sampling_seed

#: The reward of a completion of a prompt (`RunData.score`): (prompt, decoded completion) → reward in [0, 1].
ScoreFn = Callable[[Prompt, str], float]


def student_accuracy(
    model: Any, tokenizer: Any, prompts: Mapping[str, Sequence[Prompt]], max_new_tokens: int
) -> dict[str, float]:
    """route → greedy accuracy of an in-process `model` on the route's held-out prompts (the reference the
    served evaluation is tested against, and benchmarks/fidelity.py's curve; the run does not call it)."""
    return {
        route: evaluate_prompts(
            model, tokenizer, list(p), source=route, max_new_tokens=max_new_tokens
        ).accuracy
        for route, p in prompts.items()
    }


@dataclass(frozen=True, slots=True)
class EngineEval:
    """The student's greedy evaluation on the rollout engines.

    Attributes:
        accuracy: route → share of its prompts answered with reward exactly 1.
        completions: route → the decoded completion of each prompt, in prompt order (special tokens skipped).
        weight_versions: the distinct weight_version the engines answered with, sorted.
    """

    accuracy: dict[str, float]
    completions: dict[str, tuple[str, ...]]
    weight_versions: tuple[str, ...]

    @property
    def weight_version(self) -> str | None:
        """The one version, or the versions joined by ","; None when nothing was generated."""
        return ",".join(self.weight_versions) if self.weight_versions else None


async def engine_greedy(
    clients: Sequence[RolloutClient], prompt_ids: Sequence[Sequence[int]], max_new_tokens: int, eos_id: int
) -> list[GeneratedSample]:
    """Greedy completions (temperature 0, stop at `eos_id` and the engine's own EOS ids, no log-probs) of
    `prompt_ids`, spread over the engines in contiguous blocks as a rollout step's (`engine_blocks`);
    one sample per prompt, in prompt order.

    Raises:
        RolloutServerError / RolloutUnavailableError: an engine failed; ValueError: an engine answered
            another number of samples than it was given prompts (naming it).
    """
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=(eos_id,))

    async def one(client: RolloutClient, block: range) -> list[GeneratedSample]:
        ids = [prompt_ids[i] for i in block]
        samples = await client.generate(ids, sampling, return_logprob=False)
        if len(samples) != len(ids):
            raise ValueError(f"{client.base_url} answered {len(samples)} samples for {len(ids)} prompts")
        return samples

    blocks = engine_blocks(len(prompt_ids), len(clients))
    parts = await asyncio.gather(*(one(c, b) for c, b in zip(clients, blocks, strict=True) if b))
    return [s for part in parts for s in part]


async def student_accuracy_on_engines(
    clients: Sequence[RolloutClient],
    tokenizer: Any,
    prompts: Mapping[str, Sequence[Prompt]],
    max_new_tokens: int,
    score: ScoreFn = score_completion,
) -> EngineEval:
    """route → greedy accuracy (pass@1) of the weights the rollout engines hold now (module docstring).

    Prompts are encoded as `data.evaluation.greedy_complete` encodes them (`data.chat.encode_prompts`: raw
    text or the source's chat template) and the new tokens decoded the same way (special tokens skipped);
    `score` is the reward. Raises as `engine_greedy`.
    """

    async def greedy(ids: list[list[int]]) -> list[GeneratedSample]:
        return await engine_greedy(clients, ids, max_new_tokens, tokenizer.eos_token_id)

    return await _per_route(greedy, 1, tokenizer, prompts, score)


async def student_mean_at_k(
    clients: Sequence[RolloutClient],
    tokenizer: Any,
    prompts: Mapping[str, Sequence[Prompt]],
    sampling: SamplingConfig,
    k: int,
    seed: int,
    score: ScoreFn = score_completion,
) -> EngineEval:
    """route → mean@k of the weights the rollout engines hold now: k samples per prompt at `sampling`'s
    temperature, top_p and max_new_tokens, stopped at the tokenizer's EOS as the greedy ones, seeds
    `sampling_seed(seed, 0, i)` (+ j for copy j, the engine's rule) for the i-th prompt of the route; the share
    of the k·n completions of the route with reward exactly 1 (module docstring). `completions[route]` holds them prompt-major (copy j of prompt i at i·k + j).

    Raises:
        ValueError: k < 1. RolloutServerError / RolloutUnavailableError: an engine failed.
    """
    if k < 1:
        raise ValueError(f"mean@k needs k >= 1 samples per prompt (got {k}): data.eval.samples")

    async def sampled(ids: list[list[int]]) -> list[GeneratedSample]:
        seeds = [sampling_seed(seed, 0, i) for i in range(len(ids))]
        eos = (tokenizer.eos_token_id,)
        return await generate(clients, ids, sampling, k, seeds, stop_token_ids=eos, return_logprob=False)

    return await _per_route(sampled, k, tokenizer, prompts, score)


async def _per_route(
    generate_fn: Callable[[list[list[int]]], Awaitable[list[GeneratedSample]]],
    copies: int,
    tokenizer: Any,
    prompts: Mapping[str, Sequence[Prompt]],
    score: ScoreFn,
) -> EngineEval:
    """Each route's prompts encoded (the tokenizer's special tokens), generated by `generate_fn` (`copies`
    samples per prompt, prompt-major), decoded (special tokens skipped) and scored: the `EngineEval`."""
    accuracy: dict[str, float] = {}
    completions: dict[str, tuple[str, ...]] = {}
    versions: set[str] = set()
    for route, items in prompts.items():
        if not items:
            continue
        samples = await generate_fn(encode_prompts(tokenizer, items))
        texts = tuple(tokenizer.decode(list(s.output_ids), skip_special_tokens=True) for s in samples)
        accuracy[route] = _accuracy([p for p in items for _ in range(copies)], texts, score)
        completions[route] = texts
        versions.update(s.weight_version for s in samples)
    return EngineEval(accuracy, completions, tuple(sorted(versions)))


def _accuracy(items: Sequence[Prompt], completions: Sequence[str], score: ScoreFn) -> float:
    rewards = [score(p, c) for p, c in zip(items, completions, strict=True)]
    return sum(is_correct(r) for r in rewards) / len(rewards)


#: A teacher's greedy generation where it is served: (prompt ids [B rows], max_new_tokens, eos id, pad id)
#: → new-token rows ([B] of equal length, pad after EOS). `TeacherClient.generate_greedy` is one.
GreedyFn = Callable[[Sequence[Sequence[int]], int, int, int], Awaitable[list[list[int]]]]


async def teacher_accuracy(
    generators: Mapping[str, GreedyFn],
    route_weights: Mapping[str, Mapping[str, float]],
    tokenizer: Any,
    prompts: Mapping[str, Sequence[Prompt]],
    max_new_tokens: int,
    score: ScoreFn = score_completion,
) -> dict[str, dict[str, float]]:
    """route → {teacher id: greedy accuracy} for every teacher with a positive weight on the route.

    Each teacher generates on its own server (`generators`, engines/teacher/greedy_generate.py): the actor process
    loads no teacher. Prompts are encoded as `data.evaluation.greedy_complete` encodes them (`data.chat.encode_prompt`; the
    server left-pads) and the new tokens decoded the same way, so on the same weights and
    dtype the accuracy equals the in-process greedy evaluation's.
    """
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    out: dict[str, dict[str, float]] = {route: {} for route in prompts}
    for route, items in prompts.items():
        ids = encode_prompts(tokenizer, items)
        for teacher, weight in route_weights[route].items():
            if weight <= 0 or teacher not in generators or not items:
                continue
            rows = await generators[teacher](ids, max_new_tokens, eos, pad)
            out[route][teacher] = _accuracy(
                items, tokenizer.batch_decode(rows, skip_special_tokens=True), score
            )
    return out


def eval_record(
    teachers: Mapping[str, Mapping[str, float]],
    student_start: Mapping[str, float],
    student_end: Mapping[str, float] | None,
    counts: Mapping[str, int],
    student_weights: Mapping[str, str | None] | None = None,
) -> dict[str, Any]:
    """The eval.json object (module docstring); `student_weights`: {"start": version, "end": version}."""
    routes = {}
    for route, n in counts.items():
        best = max(teachers.get(route, {}).values(), default=None)
        routes[route] = {
            "teacher": best,
            "student_start": student_start.get(route),
            "student_end": None if student_end is None else student_end.get(route),
            "n": n,
        }
    weights = {"start": None, "end": None} | dict(student_weights or {})
    return {
        "routes": routes,
        "teachers": {r: dict(t) for r, t in teachers.items()},
        "student_weights": weights,
    }


def write_eval(run_dir: Path, record: Mapping[str, Any]) -> Path:
    path = run_dir / EVAL_FILE
    atomic_write_json(path, dict(record))
    return path
