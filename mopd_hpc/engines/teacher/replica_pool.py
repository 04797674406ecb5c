"""The replicas of one teacher as one client: a step's rows split across them, balanced by tokens.

`TeacherPool(urls, token=...)` holds one `TeacherClient` per replica (each a scoring server of its own,
`models.teachers[i].replicas`; binary transport, `score_frames.py`). `score_tensors(rows, starts, top_k)`:

1. `split_rows`: each row's cost is its token count |row_b| (prompt + response: what a forward pass
   computes over); rows go, longest first, to the replica with the fewest tokens so far (greedy LPT, ties
   to the lower replica index, then the lower row), so the largest replica load is at most 4/3 of the
   optimum (Graham 1969). Each replica's rows keep their order; a replica with no rows is not called.
2. The replicas score their parts concurrently (`asyncio.gather`).
3. `merge_answers`: the parts are reassembled in row order, packed as one `ScoreTensors` — the answer one
   server would have given for all the rows (the scores of a row do not depend on the other rows of its
   call: equal to one replica's within float tolerance, tests/engines/test_teacher_replicas.py).

The replicas must answer with the same weights: a part whose teacher_id, weight_version or fingerprint
differs from the first part's raises `TeacherPoolError` naming both replicas. `onload`, `offload`,
`reload` and `health` go to every replica (concurrently) and return the list of their answers.

Shape legend: B rows, N = Σ_b |response_b| response tokens, K top-k entries.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Sequence
from typing import Any

import torch

from mopd_hpc.engines.teacher.client import ScoreResponse, TeacherClient
from mopd_hpc.engines.teacher.score_frames import ScoreTensors


class TeacherPoolError(RuntimeError):
    """The replicas of a teacher answered with different weights (the message names both replicas)."""


def split_rows(costs: Sequence[int], replicas: int) -> list[list[int]]:
    """Row indices per replica (module docstring, step 1), each list ascending.

    Args:
        costs: [B] the token count of each row (≥ 0).
        replicas: how many replicas (≥ 1).

    Raises:
        ValueError: replicas < 1.
    """
    if replicas < 1:
        raise ValueError(f"replicas={replicas}: expected >= 1")
    parts: list[list[int]] = [[] for _ in range(replicas)]
    loads = [(0, r) for r in range(replicas)]  # (tokens so far, replica): a min-heap
    for b in sorted(range(len(costs)), key=lambda b: (-int(costs[b]), b)):
        load, r = heapq.heappop(loads)
        parts[r].append(b)
        heapq.heappush(loads, (load + int(costs[b]), r))
    return [sorted(p) for p in parts]


def merge_answers(parts: Sequence[tuple[Sequence[int], ScoreTensors]], rows: int) -> ScoreTensors:
    """One answer in row order from the replicas' answers (module docstring, step 3).

    Args:
        parts: (row indices of the part, its answer) per replica called; together the indices are 0..rows-1.
        rows: B.

    Raises:
        TeacherPoolError: two parts differ in teacher_id, weight_version or fingerprint.
        ValueError: the indices do not cover 0..rows-1 exactly once, or a part's row count differs from its
            answer's.
    """
    first = parts[0][1]
    for k, (idx, answer) in enumerate(parts):
        if answer.lengths.numel() != len(idx):
            raise ValueError(f"replica part {k}: {answer.lengths.numel()} rows answered, {len(idx)} sent")
        mine, theirs = _identity(answer), _identity(first)
        if mine != theirs:
            raise TeacherPoolError(
                f"the replicas of teacher {first.teacher_id!r} hold different weights: part 0 answered "
                f"{theirs}, part {k} {mine}; expected every replica on the same checkpoint (reload them all)"
            )
    order = sorted((b, k, j) for k, (idx, _) in enumerate(parts) for j, b in enumerate(idx))
    if [b for b, _, _ in order] != list(range(rows)):
        raise ValueError(f"the parts' rows do not cover rows 0..{rows - 1} exactly once")
    answers = [a for _, a in parts]
    lengths = torch.cat([answers[k].lengths[j : j + 1] for _, k, j in order])
    lp_parts = [a.split(a.logprobs) for a in answers]
    logprobs = torch.cat([lp_parts[k][j] for _, k, j in order])
    ids = vals = None
    if all(a.topk_ids is not None and a.topk_logprobs is not None for a in answers):
        wide = any(a.topk_ids.dtype == torch.int64 for a in answers)  # type: ignore[union-attr]
        id_parts = [a.split(a.topk_ids.to(torch.int64 if wide else torch.int32)) for a in answers]  # type: ignore[union-attr]
        val_parts = [a.split(a.topk_logprobs) for a in answers]  # type: ignore[arg-type]
        ids = torch.cat([id_parts[k][j] for _, k, j in order])
        vals = torch.cat([val_parts[k][j] for _, k, j in order])
    return ScoreTensors(
        lengths, logprobs, ids, vals, first.teacher_id, first.weight_version, first.fingerprint
    )


def _identity(answer: ScoreTensors) -> dict[str, str]:
    return {
        "teacher_id": answer.teacher_id,
        "weight_version": answer.weight_version,
        "fingerprint": answer.fingerprint,
    }


class TeacherPool:
    """One teacher's replicas as one client (module docstring). Use as `async with TeacherPool(urls) as p:`.

    Args:
        urls: "http://host:port" of each replica, in replica order (at least one).
        name: the teacher's id; each replica's errors name it and the replica (`'chain' replica 1`).
        **client_kwargs: passed to each replica's `TeacherClient` (token, timeout_s, max_body_bytes, ...).

    Raises:
        ValueError: no URL.
    """

    def __init__(self, urls: Sequence[str], name: str | None = None, **client_kwargs: Any) -> None:
        if not urls:
            raise ValueError("a teacher pool needs at least one replica URL")
        self.urls = tuple(urls)
        names = [None if name is None else f"{name!r} replica {r}" for r in range(len(self.urls))]
        self.clients = [
            TeacherClient(url, name=n, **client_kwargs) for url, n in zip(self.urls, names, strict=True)
        ]

    async def __aenter__(self) -> TeacherPool:
        for client in self.clients:
            await client.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for client in self.clients:
            await client.close()

    @property
    def replicas(self) -> int:
        return len(self.clients)

    async def score_tensors(
        self, input_ids: Sequence[Sequence[int]], response_start: Sequence[int], top_k: int | None = None
    ) -> ScoreTensors:
        """Score rows across the replicas; the answer in row order (shapes: `TeacherClient.score_tensors`).

        Raises:
            TeacherClientError: a replica failed. TeacherPoolError: the replicas' weights differ.
            ValueError: no rows.
        """
        if not input_ids:
            raise ValueError("input_ids: expected at least one row to score")
        split = split_rows([len(r) for r in input_ids], len(self.clients))
        called = [(client, idx) for client, idx in zip(self.clients, split, strict=True) if idx]
        answers = await asyncio.gather(
            *(
                client.score_tensors([input_ids[b] for b in idx], [response_start[b] for b in idx], top_k)
                for client, idx in called
            )
        )
        return merge_answers([(idx, a) for (_, idx), a in zip(called, answers, strict=True)], len(input_ids))

    async def score(
        self, input_ids: Sequence[Sequence[int]], response_start: Sequence[int], top_k: int | None = None
    ) -> ScoreResponse:
        """`score_tensors` as the lists of `TeacherClient.score`."""
        return ScoreResponse.from_tensors(await self.score_tensors(input_ids, response_start, top_k))

    async def generate_greedy(
        self, input_ids: Sequence[Sequence[int]], max_new_tokens: int, eos_token_id: int, pad_token_id: int
    ) -> list[list[int]]:
        """Greedy new tokens per row (`TeacherClient.generate_greedy`), from replica 0 only: the run's
        evaluation asks once per run, and one replica's batches give the same tokens whatever the replica
        count (a split would change how the prompts are batched and padded)."""
        return await self.clients[0].generate_greedy(input_ids, max_new_tokens, eos_token_id, pad_token_id)

    async def memory_peaks(self) -> dict[str, dict[str, float]]:
        """Each phase's peak GPU memory since the last call (`TeacherClient.memory_peaks`), the largest over
        the replicas per phase and kind (GiB): what the busiest replica's GPU needed."""
        out: dict[str, dict[str, float]] = {}
        for peaks in await self._each("memory_peaks"):
            for phase, kinds in peaks.items():
                for kind, value in kinds.items():
                    merged = out.setdefault(phase, {})
                    merged[kind] = max(merged.get(kind, value), value)
        return out

    async def _each(self, method: str) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(getattr(c, method)() for c in self.clients)))

    async def health(self) -> list[dict[str, Any]]:
        return await self._each("health")

    async def offload(self) -> list[dict[str, Any]]:
        return await self._each("offload")

    async def onload(self) -> list[dict[str, Any]]:
        return await self._each("onload")

    async def reload(self) -> list[dict[str, Any]]:
        return await self._each("reload")
