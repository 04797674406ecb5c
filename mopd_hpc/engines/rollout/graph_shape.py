"""The one shape an HF engine's compiled decoder is padded to (torch-free: the role and the memory plan read it).

The static decoder (`static_decoder.py`) pads prompts on the left to a multiple of `BUCKET` and reserves a
multiple of `BUCKET` slots for the new tokens. On CUDA its decode step is a CUDA graph of one (rows, cache
length) shape; the role gives the engine the shape of its largest batch (`graph_rows`, `graph_length`) so that
every batch that fits replays the graphs of one compilation (`hf_engine.HFRolloutEngine` graph_shape).
"""

from __future__ import annotations

#: Prompt widths and new-token reservations are multiples of this (limits the distinct shapes).
BUCKET = 64


def round_up(n: int, to: int = BUCKET) -> int:
    """The smallest multiple of `to` that is >= n, and at least `to`."""
    return max(to, -(-n // to) * to)


def graph_length(max_prompt_tokens: int, max_new_tokens: int) -> int:
    """Cache slots of the widest batch: prompts of at most `max_prompt_tokens` tokens decoding at most
    `max_new_tokens` each (`static_decoder.cache_length`'s rule for that batch)."""
    return round_up(max_prompt_tokens) + round_up(max_new_tokens)


def graph_rows(batch_size: int, samples_per_prompt: int, engines: int, bound: int | None = None) -> int:
    """Rows one engine decodes together at most: its share of a step's rollouts, ⌈batch_size / engines⌉
    prompts × samples_per_prompt (`trainer/rollout_phase.engine_blocks` splits the step's prompts so), at most
    `bound` (`rollout.graph_rows`; None: no bound)."""
    share = -(-batch_size // engines) * samples_per_prompt
    return share if bound is None else min(share, bound)
