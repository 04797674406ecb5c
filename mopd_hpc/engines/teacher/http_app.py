"""The teacher scoring server (HTTP, aiohttp); its client is `client.py`.

A teacher child loads its checkpoint ONCE and serves forward-only scoring of the student's rollouts:

  GET  /health    {status, teacher_id, weight_version, fingerprint, resident}
  POST /score     {input_ids: [[int]], response_start: [int], top_k: int | null}
                  → {logprobs: [[float]] (one per response token of each row),
                     topk_ids / topk_logprobs: [[[...]]] (per row, per response token, K = min(top_k, V))
                     when top_k is given, teacher_id, weight_version, fingerprint}
  POST /offload   move the weights to host memory (GPU: real; CPU: logged no-op) → the residency report
  POST /onload    the reverse
  POST /reload    reload from the checkpoint path only when its fingerprint changed → {reloaded, ...}
  POST /generate_greedy  greedy completions for the run's evaluation (`greedy_generate.py`)
  POST /memory_peaks  peak GPU memory per phase since the last call (`engines/memory/peaks.py`; {} on CPU)

On CUDA the scoring buffers are given back to the device after each /score (`torch.cuda.empty_cache`): a
teacher that stays resident between phases holds its weights only (`plan/residency_plan.py`).

`response_start[b]` is the index in row b where the response begins (≥ 1: the first response token is
predicted from the last prompt position). Binary transport (DESIGN.md §7): a /score request may be a frame
(Content-Type application/x-mopd-tensors) and a client that sends `Accept: application/x-mopd-tensors` gets
the answer as a frame, rows packed, top-k ids int32 (layouts in `score_frames.py`); JSON stays the default
and the shape of every other route. Non-finite log-probs travel as `score_frames.LOGPROB_FLOOR` in both
encodings, so they agree bit for bit. Errors are JSON {"error": {"message", "type", "code"}}: 400 for a
bad request (field, value, expectation), 503 while the weights are offloaded, 500 for a bug.

The checkpoint fingerprint hashes the names, sizes and modification times (ns) of the checkpoint's
config and weight files — not their bytes, which for a 14B model is ~28 GB to read on every /reload.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from mopd_hpc.engines.batch import BatchError, TokenBatch
from mopd_hpc.engines.frames.buffer_pool import BufferPool
from mopd_hpc.engines.frames.codec import WireError
from mopd_hpc.engines.frames.over_http import accepts_frame, is_frame, read_frame, send_frame
from mopd_hpc.engines.memory.peaks import PeakTracker, add_peaks_route, peak_middleware
from mopd_hpc.engines.packed_batch import token_batch_from_packed
from mopd_hpc.engines.protocol import EngineError
from mopd_hpc.engines.teacher.greedy_generate import GreedyRequestError, generate_route
from mopd_hpc.engines.teacher.score_frames import PackedAnswer, decode_score_request, pack_answer
from mopd_hpc.engines.torch.scoring import TorchScoringEngine

log = logging.getLogger("mopd_hpc.teacher")

#: Files whose (name, size, mtime) make up a checkpoint's fingerprint.
FINGERPRINT_PATTERNS = (
    "config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "*.bin",
    "*.bin.index.json",
)


class TeacherRequestError(ValueError):
    """A /score request is malformed (HTTP 400); the message names the field, value and expectation."""


class NonFiniteScoreError(ValueError):
    """The scoring forward gave a NaN log-prob at a response position (answered 500, naming row and position)."""


def checkpoint_fingerprint(path: str | Path) -> str:
    """sha256 (hex, 16 chars) of the sorted (name, size, mtime_ns) of the checkpoint's config and weights.

    Raises:
        FileNotFoundError: `path` is not a directory or holds no config/weight file.
    """
    root = Path(path)
    files = sorted({f for pattern in FINGERPRINT_PATTERNS for f in root.glob(pattern) if f.is_file()})
    if not files:
        raise FileNotFoundError(f"no checkpoint files ({', '.join(FINGERPRINT_PATTERNS)}) in {root}")
    digest = hashlib.sha256()
    for f in files:
        st = f.stat()
        digest.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class ScoreRequest:
    """A validated /score body. Build with `ScoreRequest.from_json(body, vocab_size)`."""

    input_ids: tuple[tuple[int, ...], ...]
    response_start: tuple[int, ...]
    top_k: int | None

    @classmethod
    def from_json(cls, body: Any, vocab_size: int) -> ScoreRequest:
        if not isinstance(body, dict):
            raise TeacherRequestError(f"body is {type(body).__name__}; expected a JSON object")
        unknown = sorted(set(body) - {"input_ids", "response_start", "top_k"})
        if unknown:
            raise TeacherRequestError(f"unknown fields {unknown}; expected input_ids, response_start, top_k")
        rows, starts, top_k = body.get("input_ids"), body.get("response_start"), body.get("top_k")
        if not isinstance(rows, list) or not rows or not all(isinstance(r, list) for r in rows):
            raise TeacherRequestError("input_ids: expected a non-empty list of lists of token ids")
        for b, row in enumerate(rows):
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in row):
                raise TeacherRequestError(f"input_ids[{b}]: expected token ids in [0, {vocab_size})")
        if not isinstance(starts, list) or len(starts) != len(rows):
            raise TeacherRequestError(f"response_start: expected a list of {len(rows)} ints (one per row)")
        for b, (row, start) in enumerate(zip(rows, starts, strict=True)):
            if not isinstance(start, int) or isinstance(start, bool) or not 1 <= start <= len(row):
                raise TeacherRequestError(
                    f"response_start[{b}] is {start!r}; expected an int in [1, {len(row)}]"
                )
        if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
            raise TeacherRequestError(f"top_k is {top_k!r}; expected null or an int >= 1")
        return cls(tuple(tuple(r) for r in rows), tuple(starts), top_k)


#: The phase of the step each tracked route runs in (`engines/memory/peaks.py`).
PHASE_OF_PATH = {"/score": "teacher", "/onload": "teacher", "/offload": "drain"}


class TeacherServer:
    """The HTTP surface of one teacher over a `TorchScoringEngine` (routes in the module docstring).

    `max_body_bytes` bounds a request body (JSON or frame), in bytes; larger ones are refused (400).
    """

    def __init__(
        self,
        engine: TorchScoringEngine,
        teacher_id: str,
        model_path: str,
        pad_id: int = 0,
        max_body_bytes: int = 1 << 30,
    ) -> None:
        self.engine = engine
        self.max_body_bytes = max_body_bytes
        self.pieces = BufferPool(keep=4)  # buffers of streamed answer pieces, reused across answers
        self.teacher_id = teacher_id
        self.model_path = model_path
        self.pad_id = pad_id
        self.fingerprint = checkpoint_fingerprint(model_path)
        self.weight_version = 1
        self.lock = asyncio.Lock()
        self.peaks = PeakTracker(getattr(getattr(engine, "residency", None), "device", None))

    def app(self) -> web.Application:
        track = peak_middleware(self.peaks, PHASE_OF_PATH)
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._errors, track])
        add_peaks_route(app.router, self.peaks)
        app.router.add_get("/health", self.health)
        app.router.add_post("/score", self.score)
        app.router.add_post("/offload", self.offload)
        app.router.add_post("/onload", self.onload)
        app.router.add_post("/reload", self.reload)
        app.router.add_post("/generate_greedy", self.generate_greedy)
        return app

    def _identity(self) -> dict[str, Any]:
        return {
            "teacher_id": self.teacher_id,
            "weight_version": str(self.weight_version),
            "fingerprint": self.fingerprint,
        }

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except (TeacherRequestError, GreedyRequestError, BatchError, WireError, json.JSONDecodeError) as err:
            return _error(400, err)
        except EngineError as err:
            return _error(503, err)
        except Exception as err:  # a bug: report it and keep serving
            log.exception("teacher %s: %s %s failed", self.teacher_id, request.method, request.path)
            return _error(500, err)

    async def health(self, request: web.Request) -> web.Response:
        body = {"status": "ok", "resident": self.engine.residency.on_device} | self._identity()
        return web.json_response(body)

    async def score(self, request: web.Request) -> web.Response:
        vocab = self.engine.vocab_size
        if is_frame(request):  # binary transport: validated tensors, no Python lists
            ids, lengths, starts, top_k = decode_score_request(
                await read_frame(request, self.max_body_bytes), vocab
            )
            batch = token_batch_from_packed(ids, lengths, starts, self.pad_id)
        else:
            req = ScoreRequest.from_json(await request.json(), vocab)
            batch, top_k = TokenBatch.from_rows(req.input_ids, req.response_start, self.pad_id), req.top_k
        async with self.lock:
            answer = await asyncio.to_thread(self._score, batch, top_k)
        if (nan := answer.nan) is not None:
            b, t, count = nan
            raise NonFiniteScoreError(
                f"teacher {self.teacher_id!r}: its log-prob of row {b}'s response token {t} is NaN ({count} NaN "
                "in the batch): a broken forward (an overflow in its dtype, damaged weights), not a refusal; "
                "nothing of this batch is answered"
            )
        if accepts_frame(request):
            return await send_frame(request, answer.frame(self._identity()), self.pieces)
        body: dict[str, Any] = {"logprobs": answer.rows(answer.logprobs)}
        if answer.topk_ids is not None and answer.topk_logprobs is not None:
            body["topk_ids"] = answer.rows(answer.topk_ids)
            body["topk_logprobs"] = answer.rows(answer.topk_logprobs)
        return web.json_response(body | self._identity())

    async def generate_greedy(self, request: web.Request) -> web.Response:
        return web.json_response(await generate_route(self, await request.json()) | self._identity())

    def _score(self, batch: TokenBatch, top_k: int | None) -> PackedAnswer:
        """The engine's score left on its device, packed there and copied to the host once
        (`score_frames.pack_answer`), then the device's buffers given back (module docstring)."""
        logprobs, top = self.engine.score(batch, top_k, host=False)
        ids, vals = (None, None) if top is None else (top.indices, top.logprobs)
        answer = pack_answer(batch.response_lengths, logprobs, ids, vals, self.engine.vocab_size)
        del logprobs, top, ids, vals
        if self.peaks.active:
            import torch

            torch.cuda.empty_cache()
        return answer

    async def offload(self, request: web.Request) -> web.Response:
        async with self.lock:
            report = await asyncio.to_thread(self.engine.offload)
        return web.json_response(asdict(report) | self._identity())

    async def onload(self, request: web.Request) -> web.Response:
        async with self.lock:
            report = await asyncio.to_thread(self.engine.onload)
        return web.json_response(asdict(report) | self._identity())

    async def reload(self, request: web.Request) -> web.Response:
        async with self.lock:
            fingerprint = await asyncio.to_thread(checkpoint_fingerprint, self.model_path)
            reloaded = fingerprint != self.fingerprint
            if reloaded:
                await asyncio.to_thread(self.engine.load_weights, self.model_path)
                self.fingerprint = fingerprint
                self.weight_version += 1
                log.info(
                    "teacher %s: reloaded %s (fingerprint %s)", self.teacher_id, self.model_path, fingerprint
                )
            else:
                log.info(
                    "teacher %s: checkpoint unchanged (fingerprint %s): no reload",
                    self.teacher_id,
                    fingerprint,
                )
        return web.json_response({"reloaded": reloaded} | self._identity())


def _error(status: int, err: BaseException) -> web.Response:
    body = {"error": {"message": str(err), "type": type(err).__name__, "code": status}}
    return web.json_response(body, status=status)
