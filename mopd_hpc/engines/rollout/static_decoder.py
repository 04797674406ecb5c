"""The static decoder: a preallocated KV cache, batched counter-based sampling, finished rows masked.

Shape legend: B rows, W bucketed prompt width, T the batch's largest max_new_tokens, C = W + bucket(T) the
cache length, V vocabulary size.

Layout: prompts are padded on the left to W (a multiple of `BUCKET`, to limit distinct shapes); the
prompt of row b fills cache slots [W - len_b, W), its t-th new token slot W + t. The attention mask is a
prepared 4D mask over all C slots (True/0 where the key is the row's real token at or before the query;
a padded query sees only itself, so no row of the softmax is empty), so the model's own mask builder and
its cache offsets are bypassed; position ids count real tokens only, as in the loop decoder. The mask of
a forward spans the first `span(n)` slots of the cache, n the slots written once it has run (W at the
prefill, W + t + 1 at step t): eagerly, the written slots exactly, the cache's layers returning only those
(`kv_view`); with CUDA graphs, n rounded up to one of a few spans (`graph_shape.attention_span`, one graph
each), the attention reading the prefix of the cache its mask spans (`grouped_attention.py`); or all C
slots (span None: one shape, for any attention).

Each step samples every row in one batched op: μ from `sampling.behavior_logprobs`, the draw from
`sampling.sample_with_uniforms` with the uniform `counter_rng.uniforms(key(seed), t)`, so a row's tokens
depend only on its seed and its logits. Finished rows keep decoding (their tokens are ignored); tokens and
log-probs accumulate in device buffers; the host reads "all finished" every `CHECK_EVERY` steps and the
buffers once at the end. The gate is asked before every step (False: unfinished rows end with abort).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mopd_hpc.engines.rollout.counter_rng import row_keys, uniforms
from mopd_hpc.engines.rollout.graph_shape import BUCKET, round_up
from mopd_hpc.engines.rollout.protocol import GREEDY_TEMPERATURE
from mopd_hpc.engines.rollout.sampling import behavior_logprobs, sample_with_uniforms

CHECK_EVERY = 16
ABORT = {"type": "abort", "message": "aborted by /pause_generation"}


def kv_view(cache: Any) -> Callable[[int], None] | None:
    """Make each layer of a StaticCache return only its first `n` slots from `update` (the slots written so
    far), n set by the returned callable before each forward; the attention then reads the real length, not
    all C slots. None where the cache has no `layers` (then use the full width)."""
    layers = getattr(cache, "layers", None)
    if not layers:
        return None
    end = [0]

    def wrap(update):
        def sliced(*args, **kwargs):
            keys, values = update(*args, **kwargs)
            return keys[:, :, : end[0]], values[:, :, : end[0]]

        return sliced

    for layer in layers:
        layer.update = wrap(layer.update)

    def set_end(n: int) -> None:
        end[0] = n

    return set_end


# forward(input_ids [B, q], mask4d [B, 1, q, C], position_ids [B, q], cache, cache_position [q]) -> [B, V]
StepForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class StaticRow:
    """One row: its prompt, sampling parameters, stop ids (eos included unless ignore_eos) and seed."""

    prompt_ids: tuple[int, ...]
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop_ids: frozenset[int]
    seed: int


@dataclass(frozen=True, slots=True)
class StaticOut:
    """output_logprobs[t]: log μ(output_ids[t]); finish: SGLang's finish_reason object."""

    output_ids: list[int]
    output_logprobs: list[float]
    finish: dict[str, Any]


def cache_length(rows: Sequence[StaticRow], min_length: int = 0) -> tuple[int, int]:
    """(W, C): the bucketed prompt width and the cache length the batch needs (at least `min_length`: a
    compiled decoder's fixed length, so that batches of other widths replay the same CUDA graphs)."""
    width = round_up(max(len(r.prompt_ids) for r in rows), BUCKET)
    return width, max(min_length, width + round_up(max(r.max_new_tokens for r in rows), BUCKET))


def padding_rows(count: int) -> list[StaticRow]:
    """`count` rows that decode nothing (max_new_tokens 0: finished before the first step), to fill a batch
    up to a compiled decoder's fixed row count; their slots compute and their results are dropped."""
    return [StaticRow((0,), 1.0, 1.0, -1, 0, frozenset(), seed=0) for _ in range(count)]


def decode_static(
    rows: Sequence[StaticRow],
    forward: StepForward,
    cache: Any,
    gate: Any,
    device: torch.device,
    mask_value: Callable[[torch.Tensor], torch.Tensor],
    span: Callable[[int], int] | None = None,
    min_length: int = 0,
) -> list[StaticOut]:
    """Decode `rows` as one batch into `cache` (C = cache_length(rows, min_length)[1] slots); one result per
    row.

    mask_value maps the boolean "may attend" mask to what the attention implementation takes (itself for
    SDPA, 0/−inf-like additive floats for eager). gate.between_steps() is asked before every step.
    span: the width of a forward's mask (the slots its attention reads) once n slots are written (W at the
    prefill, W + t + 1 at step t), n <= span(n) <= C: the identity for a cache whose layers return only the
    written slots (`kv_view`), `graph_shape.attention_span` for an attention that reads the prefix its mask
    spans (`grouped_attention.py`); None: all C slots (a fixed shape, for CUDA graphs on any attention).
    """
    n = len(rows)
    width, clen = cache_length(rows, min_length)
    lengths = torch.tensor([len(r.prompt_ids) for r in rows], dtype=torch.long)
    ids = torch.zeros((n, width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids, dtype=torch.long)
    ids, lengths = ids.to(device), lengths.to(device)
    pad = width - lengths  # [B] first real slot
    slots = torch.arange(clen, device=device)
    real = slots[None, :] >= pad[:, None]  # [B, C]
    temperature = torch.tensor([r.temperature for r in rows], dtype=torch.float32, device=device)
    top_p = torch.tensor([r.top_p for r in rows], dtype=torch.float32, device=device)
    top_k = torch.tensor([r.top_k for r in rows], dtype=torch.long, device=device)
    any_truncated = any(  # known from the request (a superset of the rows that truncate): no per-step sync
        not (r.temperature < GREEDY_TEMPERATURE or r.top_k == 1) and (r.top_p < 1.0 or r.top_k > 0)
        for r in rows
    )
    max_new = torch.tensor([r.max_new_tokens for r in rows], dtype=torch.long, device=device)
    width_stops = max(1, max(len(r.stop_ids) for r in rows))
    stop_tab = torch.full((n, width_stops), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        stop_tab[i, : len(r.stop_ids)] = torch.tensor(sorted(r.stop_ids), dtype=torch.long)
    stop_tab = stop_tab.to(device)
    keys = row_keys([r.seed for r in rows], device)
    steps = max(r.max_new_tokens for r in rows)
    out_ids = torch.zeros((n, max(steps, 1)), dtype=torch.long, device=device)
    out_lps = torch.zeros((n, max(steps, 1)), dtype=torch.float32, device=device)
    done = max_new == 0
    stopped = torch.zeros(n, dtype=torch.bool, device=device)
    finish_step = torch.full((n,), -1, dtype=torch.long, device=device)
    aborted_at: int | None = None
    width_of = (lambda written: clen) if span is None else span
    if steps > 0:
        q = torch.arange(width, device=device)
        see = (slots[None, None, :] <= q[None, :, None]) & (
            real[:, None, :] | (slots[None, None, :] == q[None, :, None])
        )  # [B, W, C]
        pos = (q[None, :] - pad[:, None]).clamp(min=0)
        last = forward(ids, mask_value(see[:, None, :, : width_of(width)]), pos, cache, q)
        for t in range(steps):
            if not gate.between_steps():
                aborted_at = t
                break
            logp = behavior_logprobs(last, temperature, top_p, top_k, any_truncated=any_truncated)
            out = sample_with_uniforms(last, logp, temperature, top_k, uniforms(keys, t))
            live = ~done
            out_ids[:, t] = out.token_ids
            out_lps[:, t] = out.logprobs
            hit_stop = live & (out.token_ids[:, None] == stop_tab).any(-1)
            new = hit_stop | (live & (max_new <= t + 1))
            finish_step = torch.where(new, t, finish_step)
            stopped |= hit_stop
            done = done | new
            if t + 1 == steps or ((t + 1) % CHECK_EVERY == 0 and bool(done.all())):
                break
            slot = width + t
            end = width_of(slot + 1)
            mask = real[:, :end] & (slots[None, :end] <= slot)
            last = forward(
                out.token_ids[:, None],
                mask_value(mask[:, None, None, :]),
                (lengths + t)[:, None],
                cache,
                slots[slot : slot + 1],
            )
    host = {
        k: v.tolist()
        for k, v in {
            "ids": out_ids, "lps": out_lps, "done": done, "stopped": stopped, "finish": finish_step,
        }.items()
    }  # fmt: skip
    results = []
    for i, r in enumerate(rows):
        if host["done"][i]:
            count = host["finish"][i] + 1
            if host["stopped"][i]:
                finish = {"type": "stop", "matched": host["ids"][i][count - 1]}
            else:
                finish = {"type": "length", "length": r.max_new_tokens}
        else:  # still running when the gate said abort
            count, finish = (aborted_at or 0), dict(ABORT)
        results.append(StaticOut(host["ids"][i][:count], host["lps"][i][:count], finish))
    return results
