"""Greedy evaluation of a causal LM on a prompt source: completions, rewards, accuracy.

Shared by the tiny-model builder, the tests and the run's start/end evaluation. Accuracy is the
share of prompts whose reward is exactly 1.0 under greedy decoding of at most `max_new_tokens`
tokens (reference/tiny_calibration.md: 5 new tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mopd_hpc.data.chat import encode_prompt
from mopd_hpc.data.prompt import Prompt
from mopd_hpc.data.rewards import is_correct, score_completion

DEFAULT_MAX_NEW_TOKENS = 5
DEFAULT_BATCH_SIZE = 256


@dataclass(frozen=True, slots=True)
class EvalResult:
    """Greedy accuracy of one model on one source.

    Fields:
        source: the source's name.
        n: number of prompts scored.
        accuracy: share of prompts with reward exactly 1.0, a fraction in [0, 1].
        mean_reward: mean reward, in [0, 1].
    """

    source: str
    n: int
    accuracy: float
    mean_reward: float


def greedy_complete(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str | Prompt],
    *,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    batch_size: int = DEFAULT_BATCH_SIZE,
) -> list[str]:
    """Greedy completions of `texts` (decoded, special tokens skipped; not stripped).

    A text is encoded with the tokenizer's special tokens (BOS first for the tiny models), a `Prompt` as
    `data.chat.encode_prompt` encodes it (its source's template); both are left-padded in batches of `batch_size`; generation stops at EOS or after `max_new_tokens`.
    Batched results equal one-prompt-at-a-time results (tested).
    """
    import torch

    completions: list[str] = []
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for start in range(0, len(texts), batch_size):
                chunk = list(texts[start : start + batch_size])
                ids = [
                    encode_prompt(tokenizer, t) if isinstance(t, Prompt) else tokenizer(t)["input_ids"]
                    for t in chunk
                ]
                enc = tokenizer.pad(
                    {"input_ids": ids}, return_tensors="pt", padding=True, padding_side="left"
                )
                out = model.generate(
                    input_ids=enc["input_ids"],
                    attention_mask=enc["attention_mask"],
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                )
                new_tokens = out[:, enc["input_ids"].shape[1] :]
                completions.extend(tokenizer.batch_decode(new_tokens, skip_special_tokens=True))
    finally:
        model.train(was_training)
    return completions


def evaluate_prompts(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    *,
    source: str = "",
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    batch_size: int = DEFAULT_BATCH_SIZE,
) -> EvalResult:
    """Greedy accuracy and mean reward of `model` on `prompts` (rewards by `score_completion`).

    Raises:
        ValueError: `prompts` is empty.
    """
    if not prompts:
        raise ValueError(f"evaluate_prompts: no prompts to evaluate (source {source!r})")
    completions = greedy_complete(
        model, tokenizer, list(prompts), max_new_tokens=max_new_tokens, batch_size=batch_size
    )
    rewards = [score_completion(p, c) for p, c in zip(prompts, completions, strict=True)]
    return EvalResult(
        source=source or prompts[0].source,
        n=len(rewards),
        accuracy=sum(is_correct(r) for r in rewards) / len(rewards),
        mean_reward=sum(rewards) / len(rewards),
    )


def evaluate_source(
    model: Any,
    tokenizer: Any,
    source: Any,
    n: int | None = None,
    *,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    batch_size: int = DEFAULT_BATCH_SIZE,
) -> EvalResult:
    """Greedy accuracy of `model` on the first `n` prompts of `source` (all when `n` is None).

    `source` is any indexable prompt source (`mopd_hpc.data.sources.PromptSource`), normally a
    held-out split: `ReasoningGymSource.held_out(n)`.
    """
    count = len(source) if n is None else min(n, len(source))
    prompts = [source[i] for i in range(count)]
    return evaluate_prompts(
        model, tokenizer, prompts, source=source.name, max_new_tokens=max_new_tokens, batch_size=batch_size
    )
