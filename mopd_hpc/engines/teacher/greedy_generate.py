"""Greedy generation on a teacher server, for the run's evaluation (trainer/evaluate.py): the teacher's
accuracy is measured where the teacher is served, so the actor process loads no model but its own.

    POST /generate_greedy {input_ids: [[int]], max_new_tokens: int, eos_token_id: int, pad_token_id: int}
                          → {output_ids: [[int]] (B rows of equal length: new tokens, pad_token_id after a
                             row's EOS), teacher_id, weight_version, fingerprint}

Two paths, the same tokens up to the engine's numerics:
- a torch engine (an HF model): `model.generate(do_sample=False)` over prompts left-padded in chunks of
  `data.evaluation.DEFAULT_BATCH_SIZE` — exactly what `data.evaluation.greedy_complete` does with the
  tokenizer's left padding, so the accuracy equals the in-process evaluation's on the same weights and dtype;
- any other scoring engine (megatron): the top-1 token of `engine.topk` at one extra response position
  per step (a causal model's prediction there depends only on the prefix), without a KV cache:
  max_new_tokens forward passes of the growing rows, finished rows dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mopd_hpc.data.evaluation import DEFAULT_BATCH_SIZE
from mopd_hpc.engines.batch import TokenBatch

#: The longest greedy completion a request may ask for, in tokens.
MAX_NEW_TOKENS = 4096


class GreedyRequestError(ValueError):
    """A /generate_greedy body is malformed (HTTP 400); the message names the field and value."""


@dataclass(frozen=True, slots=True)
class GreedyRequest:
    """A validated /generate_greedy body (module docstring)."""

    input_ids: tuple[tuple[int, ...], ...]
    max_new_tokens: int
    eos_token_id: int
    pad_token_id: int

    @classmethod
    def from_json(cls, body: Any, vocab_size: int) -> GreedyRequest:
        """Raises GreedyRequestError naming the field, its value and what was expected."""
        if not isinstance(body, dict):
            raise GreedyRequestError(f"body={body!r:.80}: expected a JSON object")
        rows = body.get("input_ids")
        if not isinstance(rows, list) or not rows or not all(isinstance(r, list) and r for r in rows):
            raise GreedyRequestError(f"input_ids={rows!r:.80}: expected a non-empty list of non-empty rows")
        ids = tuple(tuple(int(t) for t in r) for r in rows)
        if any(not 0 <= t < vocab_size for r in ids for t in r):
            raise GreedyRequestError(f"input_ids: a token id outside [0, {vocab_size})")
        fields = {}
        for name, low, high in (
            ("max_new_tokens", 1, MAX_NEW_TOKENS),
            ("eos_token_id", 0, vocab_size - 1),
            ("pad_token_id", 0, vocab_size - 1),
        ):
            value = body.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise GreedyRequestError(f"{name}={value!r}: expected an integer in [{low}, {high}]")
            fields[name] = value
        return cls(ids, **fields)


def greedy_ids(engine: Any, req: GreedyRequest) -> list[list[int]]:
    """The new tokens of each row (module docstring); rows of equal length, pad_token_id after EOS."""
    model = getattr(engine, "model", None)
    if callable(getattr(model, "generate", None)):
        return _hf_greedy(model, engine.device, req)
    return _topk_greedy(engine, req)


def _hf_greedy(model: Any, device: torch.device, req: GreedyRequest) -> list[list[int]]:
    out: list[list[int]] = []
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for start in range(0, len(req.input_ids), DEFAULT_BATCH_SIZE):
                chunk = req.input_ids[start : start + DEFAULT_BATCH_SIZE]
                width = max(len(r) for r in chunk)
                ids = torch.tensor([(req.pad_token_id,) * (width - len(r)) + r for r in chunk])
                mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in chunk])
                generated = model.generate(
                    input_ids=ids.to(device),
                    attention_mask=mask.to(device),
                    max_new_tokens=req.max_new_tokens,
                    do_sample=False,
                    pad_token_id=req.pad_token_id,
                    eos_token_id=req.eos_token_id,
                )
                out.extend(generated[:, width:].cpu().tolist())
    finally:
        model.train(was_training)
    return out


def _topk_greedy(engine: Any, req: GreedyRequest) -> list[list[int]]:
    rows = [list(r) for r in req.input_ids]
    new: list[list[int]] = [[] for _ in rows]
    live = list(range(len(rows)))
    for _ in range(req.max_new_tokens):
        if not live:
            break
        # one placeholder response token per row: its top-1 is the greedy next token given the prefix
        batch = TokenBatch.from_rows(
            [rows[i] + [req.pad_token_id] for i in live], [len(rows[i]) for i in live], req.pad_token_id
        )
        top = engine.topk(batch, 1).indices[:, 0, 0].tolist()
        for i, token in zip(live, top, strict=True):
            rows[i].append(int(token))
            new[i].append(int(token))
        live = [i for i in live if new[i][-1] != req.eos_token_id]
    width = max(len(n) for n in new)
    return [n + [req.pad_token_id] * (width - len(n)) for n in new]


async def generate_route(server: Any, body: Any) -> dict[str, Any]:
    """The handler's work for a TeacherServer: validate, generate under the server's lock, answer."""
    req = GreedyRequest.from_json(body, server.engine.vocab_size)
    async with server.lock:
        ids = await asyncio.to_thread(greedy_ids, server.engine, req)
    return {"output_ids": ids}


def greedy_body(
    input_ids: Sequence[Sequence[int]], max_new_tokens: int, eos_token_id: int, pad_token_id: int
) -> dict[str, Any]:
    """The /generate_greedy body a client sends (module docstring)."""
    return {
        "input_ids": [list(r) for r in input_ids],
        "max_new_tokens": max_new_tokens,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
    }
