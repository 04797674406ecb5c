"""The one shape an HF engine's compiled decoder is padded to (torch-free: the role and the memory plan read it).

The static decoder (`static_decoder.py`) pads prompts on the left to a multiple of `BUCKET` and reserves a
multiple of `BUCKET` slots for the new tokens. On CUDA its decode step is a CUDA graph of one (rows, cache
length) shape; the role gives the engine the shape of its largest batch (`graph_rows`, `graph_length`) so that
every batch that fits replays the graphs of one compilation (`hf_engine.HFRolloutEngine` graph_shape).

Within that shape, the compiled decode step attends over a prefix of the cache, not all of it (issue 35):
the cache of C slots is cut into `SPANS` equal spans (`span_step`), and a step whose batch has written n
slots attends over the first `attention_span(n, C)` of them (n rounded up to a whole span). Each span is one
CUDA graph of its own (one compilation per span, reused by every batch of the shape), so a step reads on
average half a span beyond the written slots instead of all C.
"""

from __future__ import annotations

#: Prompt widths and new-token reservations are multiples of this (limits the distinct shapes).
BUCKET = 64
#: The compiled decode step's attention spans per cache length (one CUDA graph each; 1: all C slots).
SPANS = 8
#: Span lengths are multiples of this (aligned key/value views for the attention kernels).
SPAN_ALIGN = 16


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


def span_step(length: int, spans: int = SPANS) -> int:
    """Slots per attention span of a cache of `length` slots cut into `spans` spans: ⌈length / spans⌉ rounded
    up to `SPAN_ALIGN`. Raises ValueError for spans < 1."""
    if spans < 1:
        raise ValueError(f"spans={spans}: expected >= 1")
    return round_up(-(-length // spans), SPAN_ALIGN)


def attention_span(written: int, length: int, spans: int = SPANS) -> int:
    """The slots a step attends over once `written` of the cache's `length` slots are written: `written`
    rounded up to a whole span (`span_step`), at most `length`; at most `spans` distinct values per length."""
    return min(length, round_up(written, span_step(length, spans)))
