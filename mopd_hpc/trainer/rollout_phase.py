"""ROLLOUT: the step's prompts → responses with their behavior log-probs μ, and their rewards.

The prompts are encoded with the shared tokenizer as their sources say (`data.chat`: raw text with the
special tokens, `<bos>` first for the tiny models, or the tokenizer's chat template) and spread over the rollout engines in contiguous blocks; every prompt is sampled
`samples_per_prompt` times (SGLang `n`; copy j of prompt i at row i·n + j, so GRPO groups are contiguous).
Each prompt carries its own `sampling_seed`, a hash of (run seed, step, prompt position): a rerun of a
step (after a resume) samples the same responses from the same weights.

μ(y_t) is the engine's log-probability of the sampled token under the exact distribution it sampled from
(`return_logprob`); it is kept as it came, immutable, up to the loss (DESIGN.md §3). The reward of every
response is its source's own `score` (its `reward`: reasoning-gym `score_answer`, a verifier, a user's function), computed for monitoring even when no
loss term uses it; accuracy counts rewards of exactly 1.

Shape legend: B = prompts · samples_per_prompt rows, T response positions.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mopd_hpc.config.rollout import SamplingConfig
from mopd_hpc.data import PromptSource, is_correct
from mopd_hpc.data.chat import encode_prompts as encode_each
from mopd_hpc.engines.batch import TokenBatch
from mopd_hpc.engines.rollout.client import RolloutClient
from mopd_hpc.engines.rollout.protocol import GeneratedSample, SamplingParams
from mopd_hpc.mopd.routing import RoutedSample


class RolloutPhaseError(ValueError):
    """A prompt is too long, or an engine returned something the step cannot use (named)."""


@dataclass(frozen=True, slots=True)
class Rollouts:
    """One step's rollouts, row b = copy (b mod n) of prompt (b div n).

    Attributes:
        draws: the routed prompts, one per row (repeated n times).
        rows: prompt + response token ids per row; `starts[b]` is where row b's response begins.
        tokens: the `TokenBatch` of `rows`.
        behavior_logprobs: [B, T] float32 log μ(y_t), 0 at padding.
        rewards: [B] float32 rewards; `correct`: [B] bool (reward exactly 1).
        completions: decoded responses (special tokens skipped).
        weight_versions: the weight version each row was sampled with.
        routed_experts: [B, T, M, k] int16 expert ids each response token was routed to in the rollout (−1
            at padding), or None without rollout routing replay.
    """

    draws: tuple[RoutedSample, ...]
    rows: tuple[tuple[int, ...], ...]
    starts: tuple[int, ...]
    tokens: TokenBatch
    behavior_logprobs: torch.Tensor
    rewards: torch.Tensor
    correct: torch.Tensor
    completions: tuple[str, ...]
    weight_versions: tuple[str, ...]
    routed_experts: torch.Tensor | None = None

    @property
    def routes(self) -> tuple[str, ...]:
        return tuple(d.route for d in self.draws)

    @property
    def response_tokens(self) -> int:
        return int(self.tokens.response_mask.sum())

    def route_means(self) -> dict[str, tuple[float, float]]:
        """route → (mean reward, accuracy) over this step's rows of that route."""
        out: dict[str, tuple[float, float]] = {}
        for route in dict.fromkeys(self.routes):
            rows = torch.tensor([r == route for r in self.routes])
            out[route] = (float(self.rewards[rows].mean()), float(self.correct[rows].float().mean()))
        return out


def sampling_seed(seed: int, step: int, position: int) -> int:
    """A 31-bit seed from (run seed, step, prompt position)."""
    digest = hashlib.blake2b(f"{seed}/{step}/{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def encode_prompts(tokenizer: Any, draws: Sequence[RoutedSample], max_prompt_tokens: int) -> list[list[int]]:
    """Token ids of each prompt (`data.chat.encode_prompt`: raw text with the special tokens added, or the chat
    template's rendering). Raises RolloutPhaseError for a long prompt."""
    encoded = encode_each(tokenizer, [d.sample for d in draws])
    for draw, ids in zip(draws, encoded, strict=True):
        if len(ids) > max_prompt_tokens:
            raise RolloutPhaseError(
                f"prompt {draw.sample.text[:60]!r} of source {draw.source!r} has {len(ids)} tokens; "
                f"data.max_prompt_tokens is {max_prompt_tokens}"
            )
    return [list(ids) for ids in encoded]


def engine_blocks(rows: int, engines: int) -> list[range]:
    """The contiguous block of prompt positions each engine gets (engine e: the e-th block of ⌈rows/engines⌉;
    the last ones may be short or empty), in engine order."""
    per = -(-rows // engines)
    return [range(e * per, min(rows, (e + 1) * per)) for e in range(engines)]


async def generate(
    clients: Sequence[RolloutClient],
    prompt_ids: Sequence[Sequence[int]],
    sampling: SamplingConfig,
    n: int,
    seeds: Sequence[int],
    routing_replay: bool = False,
    *,
    stop_token_ids: Sequence[int] = (),
    return_logprob: bool = True,
) -> list[GeneratedSample]:
    """Sample n responses per prompt, prompts split over the engines in contiguous blocks (order kept);
    `stop_token_ids` end a response besides the engine's own EOS ids (the evaluation's: the tokenizer's EOS);
    `routing_replay`: each sample with its routed experts (`return_routed_experts`)."""
    calls = []
    for client, block in zip(clients, engine_blocks(len(prompt_ids), len(clients)), strict=True):
        if not block:
            continue
        params = [
            SamplingParams(
                max_new_tokens=sampling.max_new_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                sampling_seed=seeds[i],
                n=n,
                stop_token_ids=tuple(stop_token_ids),
            ).to_json()
            for i in block
        ]
        body = {
            "input_ids": [list(prompt_ids[i]) for i in block],
            "sampling_params": params,
            "return_logprob": return_logprob,
        }
        if routing_replay:
            body["return_routed_experts"] = True
        calls.append(_generate_block(client, body, [prompt_ids[i] for i in block], n))
    samples: list[GeneratedSample] = []
    for part in await asyncio.gather(*calls):
        samples.extend(part)
    return samples


async def _generate_block(
    client: RolloutClient, body: dict[str, Any], prompts: Sequence[Sequence[int]], n: int
) -> list[GeneratedSample]:
    """One engine's block: ids and μ come back as one binary frame (engines/frames/codec.py) where the server
    offers it, else as SGLang's JSON."""
    answer = await client.generate_batch(body)
    if len(answer.items) != len(prompts) * n:
        raise RolloutPhaseError(
            f"{client.base_url} returned {len(answer.items)} responses for {len(prompts)} prompts × n={n}"
        )
    return answer.samples(prompts, n)


def check_behavior_finite(
    behavior: torch.Tensor, mask: torch.Tensor, step: int, draws: Sequence[RoutedSample]
) -> None:
    """Refuse a non-finite μ at a response token (NaN, ±inf), naming the step, the row and the position.

    Why an error and not a mask or a clip: μ is the engine's log-probability of the token it sampled from
    its own distribution, finite by construction (the token had probability > 0); a non-finite one is an
    engine fault (an overflow, a wrong log-prob). The importance ratio π_θ/μ is then undefined, and masking
    the token would hide the fault while training on the rest of that engine's output. The sglang backend
    refuses the same at its edge (engines/rollout/sglang_backend.py); this check covers every backend.

    Args:
        behavior: [B, T] float32 μ (0 at padding). mask: [B, T] bool response mask. draws: row b's prompt.

    Raises:
        RolloutPhaseError: the first bad (row, position), its value and the count of bad entries.
    """
    bad = ~torch.isfinite(behavior) & mask
    if not bool(bad.any()):
        return
    b, t = (int(i) for i in bad.nonzero()[0])
    raise RolloutPhaseError(
        f"step {step}, row {b} (source {draws[b].source!r}, route {draws[b].route!r}): the behavior log-prob "
        f"μ at response position {t} is {float(behavior[b, t])} ({int(bad.sum())} non-finite in the step); "
        "expected the rollout engine's finite log-prob of each token it sampled (the importance ratio "
        "π_θ/μ is undefined otherwise): the rollout engine returned a wrong log-prob"
    )


async def collect_rollouts(
    clients: Sequence[RolloutClient],
    draws: Sequence[RoutedSample],
    *,
    tokenizer: Any,
    sources: Mapping[str, PromptSource],
    sampling: SamplingConfig,
    samples_per_prompt: int,
    max_prompt_tokens: int,
    seed: int,
    step: int,
    pad_id: int,
    routing_replay: bool = False,
) -> Rollouts:
    """The ROLLOUT phase of `step` (module docstring); `routing_replay`: with the routed experts of every
    response token (`Rollouts.routed_experts`).

    Raises:
        RolloutPhaseError: a prompt too long, a response without behavior log-probs, a non-finite μ
            (`check_behavior_finite`), or a step whose responses are all empty (named by its step).
        RolloutServerError / RolloutUnavailableError: an engine failed.
    """
    if not clients:
        raise RolloutPhaseError("no rollout engine to sample from")
    prompt_ids = encode_prompts(tokenizer, draws, max_prompt_tokens)
    seeds = [sampling_seed(seed, step, i) for i in range(len(draws))]
    samples = await generate(clients, prompt_ids, sampling, samples_per_prompt, seeds, routing_replay)
    n = samples_per_prompt
    row_draws = tuple(draws[k // n] for k in range(len(samples)))
    for k, s in enumerate(samples):
        if len(s.behavior_logprobs) != len(s.output_ids):
            raise RolloutPhaseError(
                f"response {k} has {len(s.output_ids)} tokens but {len(s.behavior_logprobs)} behavior "
                "log-probs; the engine must answer return_logprob"
            )
    if not any(s.output_ids for s in samples):
        raise RolloutPhaseError(
            f"step {step}: all {len(samples)} responses are empty (0 tokens): no token to train on (an update "
            "from none is undefined: AdamW would still move the weights by its momentum); the rollout engine "
            "stopped every sample at once: check rollout.sampling.max_new_tokens and the stop tokens"
        )
    tokens = TokenBatch.from_samples([s.prompt_ids for s in samples], [s.output_ids for s in samples], pad_id)
    behavior = tokens.pad_response_values([s.behavior_logprobs for s in samples])
    check_behavior_finite(behavior, tokens.response_mask, step, row_draws)
    completions = tuple(tokenizer.decode(list(s.output_ids), skip_special_tokens=True) for s in samples)
    rewards = [
        float(sources[d.source].score(d.sample, text)) for d, text in zip(row_draws, completions, strict=True)
    ]
    return Rollouts(
        draws=row_draws,
        rows=tuple(tuple(s.prompt_ids) + tuple(s.output_ids) for s in samples),
        starts=tuple(len(s.prompt_ids) for s in samples),
        tokens=tokens,
        behavior_logprobs=behavior,
        rewards=torch.tensor(rewards, dtype=torch.float32),
        correct=torch.tensor([is_correct(r) for r in rewards], dtype=torch.bool),
        completions=completions,
        weight_versions=tuple(s.weight_version for s in samples),
        routed_experts=padded_routes(samples, tokens.response_width) if routing_replay else None,
    )


def padded_routes(samples: Sequence[GeneratedSample], width: int) -> torch.Tensor:
    """[B, width, M, k] int16 of the samples' routed experts, −1 at padding.

    Raises:
        RolloutPhaseError: a sample without one [M, k] entry per token (the engine did not record them).
    """
    shapes = {
        tuple(s.routed_experts.shape[1:]) for s in samples if s.routed_experts is not None and s.output_ids
    }
    for k, s in enumerate(samples):
        if s.routed_experts is None or len(s.routed_experts) != len(s.output_ids) or len(shapes) > 1:
            raise RolloutPhaseError(
                f"response {k} has {len(s.output_ids)} tokens but routed experts "
                f"{None if s.routed_experts is None else list(s.routed_experts.shape)}; expected one [M, k] "
                "entry per token of one shape (rollout.routing_replay: the engine must answer return_routed_experts)"
            )
    m, top = shapes.pop() if shapes else (0, 0)
    out = torch.full((len(samples), width, m, top), -1, dtype=torch.int16)
    for b, s in enumerate(samples):
        out[b, : len(s.output_ids)] = s.routed_experts
    return out


async def step_rollouts(
    cfg: Any, data: Any, clients: Sequence[RolloutClient], tokenizer: Any, step: int, pad_id: int
) -> Rollouts:
    """The controller's ROLLOUT of `step`: data.batch_size prompts taken from `data.dataset` (a
    `trainer.data_setup.RunData`; the stream advances), sampled by `collect_rollouts` with the config's
    sampling, samples_per_prompt, max_prompt_tokens and run seed. Raises as `collect_rollouts`."""
    draws = data.dataset.take(cfg.data.batch_size)
    return await collect_rollouts(
        clients,
        draws,
        tokenizer=tokenizer,
        sources=data.sources,
        sampling=cfg.rollout.sampling,
        samples_per_prompt=cfg.data.samples_per_prompt,
        max_prompt_tokens=cfg.data.max_prompt_tokens,
        seed=cfg.seed,
        step=step,
        pad_id=pad_id,
        routing_replay=cfg.rollout.routing_replay,
    )
