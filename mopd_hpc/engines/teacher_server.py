"""The teacher scoring server (HTTP, aiohttp) and its client.

A teacher child loads its checkpoint ONCE and serves forward-only scoring of the student's rollouts:

  GET  /health    {status, teacher_id, weight_version, fingerprint, resident}
  POST /score     {input_ids: [[int]], response_start: [int], top_k: int | null}
                  → {logprobs: [[float]] (one per response token of each row),
                     topk_ids / topk_logprobs: [[[...]]] (per row, per response token, K = min(top_k, V))
                     when top_k is given, teacher_id, weight_version, fingerprint}
  POST /offload   move the weights to host memory (GPU: real; CPU: logged no-op) → the residency report
  POST /onload    the reverse
  POST /reload    reload from the checkpoint path only when its fingerprint changed → {reloaded, ...}
  POST /generate_greedy  greedy completions for the run's evaluation (`teacher_generate.py`)
  POST /memory_peaks  peak GPU memory per phase since the last call (`engines/peak_memory.py`; {} on CPU)

On CUDA the scoring buffers are given back to the device after each /score (`torch.cuda.empty_cache`): a
teacher that stays resident between phases holds its weights only (`engines/residency_plan.py`).

`response_start[b]` is the index in row b where the response begins (≥ 1: the first response token is
predicted from the last prompt position). Binary transport (DESIGN.md §7): a /score request may be a frame
(Content-Type application/x-mopd-tensors) and a client that sends `Accept: application/x-mopd-tensors` gets
the answer as a frame, rows packed, top-k ids int32 (layouts in `teacher_wire.py`); JSON stays the default
and the shape of every other route. Non-finite log-probs travel as `teacher_wire.LOGPROB_FLOOR` in both
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
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from mopd_hpc.engines.batch import BatchError, TokenBatch
from mopd_hpc.engines.buffer_pool import BufferPool
from mopd_hpc.engines.peak_memory import PeakTracker, add_peaks_route, peak_middleware
from mopd_hpc.engines.protocol import EngineError
from mopd_hpc.engines.teacher_generate import GreedyRequestError, generate_route, greedy_body
from mopd_hpc.engines.teacher_wire import (
    ScoreTensors,
    decode_score_request,
    encode_score_request,
    first_nan,
    floor_nonfinite,
    score_answer,
)
from mopd_hpc.engines.torch_engine import TorchScoringEngine
from mopd_hpc.engines.wire import DEFAULT_MAX_BODY_BYTES, WireError
from mopd_hpc.engines.wire_http import FRAME_HEADERS, accepts_frame, is_frame, read_frame, send_frame
from mopd_hpc.runtime.http_auth import auth_headers

log = logging.getLogger("mopd_hpc.teacher")

#: Files whose (name, size, mtime) make up a checkpoint's fingerprint.
FINGERPRINT_PATTERNS = (
    "config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "*.bin",
    "*.bin.index.json",
)
#: Default client timeout of one request, in seconds (scoring a large batch on CPU can take a while).
DEFAULT_TIMEOUT_S = 600.0


class TeacherRequestError(ValueError):
    """A /score request is malformed (HTTP 400); the message names the field, value and expectation."""


class NonFiniteScoreError(ValueError):
    """The scoring forward gave a NaN log-prob at a response position (answered 500, naming row and position)."""


class TeacherClientError(RuntimeError):
    """The teacher server answered with an error status or an unreadable body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"teacher server error {status}: {message}")
        self.status = status


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


#: The phase of the step each tracked route runs in (`engines/peak_memory.py`).
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
            batch = TokenBatch.from_packed(ids, lengths, starts, self.pad_id)
        else:
            req = ScoreRequest.from_json(await request.json(), vocab)
            batch, top_k = TokenBatch.from_rows(req.input_ids, req.response_start, self.pad_id), req.top_k
        async with self.lock:
            logprobs, top = await asyncio.to_thread(self._score, batch, top_k)
        if (nan := first_nan(logprobs, batch.response_lengths)) is not None:
            b, t, count = nan
            raise NonFiniteScoreError(
                f"teacher {self.teacher_id!r}: its log-prob of row {b}'s response token {t} is NaN ({count} NaN "
                "in the batch): a broken forward (an overflow in its dtype, damaged weights), not a refusal; "
                "nothing of this batch is answered"
            )
        if accepts_frame(request):
            ids, vals = (None, None) if top is None else (top.indices, top.logprobs)
            frame = score_answer(batch.response_lengths, logprobs, ids, vals, self._identity(), vocab)
            return await send_frame(request, frame, self.pieces)
        body: dict[str, Any] = {"logprobs": batch.unpad_response_values(floor_nonfinite(logprobs))}
        if top is not None:
            lengths = batch.response_lengths.tolist()
            values = floor_nonfinite(top.logprobs)
            body["topk_ids"] = [top.indices[b, :n].tolist() for b, n in enumerate(lengths)]
            body["topk_logprobs"] = [values[b, :n].tolist() for b, n in enumerate(lengths)]
        return web.json_response(body | self._identity())

    async def generate_greedy(self, request: web.Request) -> web.Response:
        return web.json_response(await generate_route(self, await request.json()) | self._identity())

    def _score(self, batch: TokenBatch, top_k: int | None) -> tuple[Any, Any]:
        """The engine's score (CPU tensors), then its buffers given back to the device (module docstring)."""
        answer = self.engine.score(batch, top_k)
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


@dataclass(frozen=True, slots=True)
class ScoreResponse:
    """A /score answer: per-row log-probs of the response tokens, and top-k when asked."""

    logprobs: list[list[float]]
    topk_ids: list[list[list[int]]] | None
    topk_logprobs: list[list[list[float]]] | None
    weight_version: str
    fingerprint: str

    @classmethod
    def from_tensors(cls, answer: ScoreTensors) -> ScoreResponse:
        """The same lists the JSON answer gives (bit for bit), from a binary answer."""
        lists = [r.tolist() for r in answer.split(answer.logprobs)]
        ids = None if answer.topk_ids is None else [r.tolist() for r in answer.split(answer.topk_ids)]
        vals = None
        if answer.topk_logprobs is not None:
            vals = [r.tolist() for r in answer.split(answer.topk_logprobs)]
        return cls(lists, ids, vals, answer.weight_version, answer.fingerprint)


class TeacherClient:
    """asyncio client of one teacher server. Use as `async with TeacherClient(url) as client: ...`.

    Args:
        url: "http://host:port".
        timeout_s: total time allowed per request, in seconds.
        connect_timeout_s: time allowed to connect, in seconds.
        binary: `score` travels as frames (binary transport) when True, as JSON when False; the answer
            is the same, bit for bit. `score_tensors` is always binary.
        max_body_bytes: the largest answer frame accepted, in bytes (larger: TeacherClientError).
        keep_buffers: answer buffers kept for reuse once the tensors of an answer are dropped (0: none);
            each is as large as the largest answer.
        token: the job's token, sent with every request (`runtime/http_auth.py`; a job's server answers 401
            without it); None sends none.
    """

    def __init__(
        self,
        url: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        connect_timeout_s: float = 10.0,
        *,
        binary: bool = True,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        keep_buffers: int = 1,
        token: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self._headers = auth_headers(token)
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, connect=connect_timeout_s)
        self.binary, self.max_body_bytes = binary, max_body_bytes
        self.buffers = BufferPool(keep=keep_buffers)
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def from_endpoint(cls, endpoint: Mapping[str, Any], **kwargs: Any) -> TeacherClient:
        """From a replica's `run_dir/endpoints/teacher-<id>.r<replica>.json` record ({host, port, ...})."""
        return cls(f"http://{endpoint['host']}:{int(endpoint['port'])}", **kwargs)

    async def __aenter__(self) -> TeacherClient:
        self._session = aiohttp.ClientSession(timeout=self.timeout, headers=self._headers)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        if self._session is None:
            raise RuntimeError("TeacherClient used outside `async with` (no session)")
        async with self._session.request(method, self.url + path, json=body) as resp:
            try:
                data = await resp.json()
            except (aiohttp.ContentTypeError, json.JSONDecodeError):
                raise TeacherClientError(resp.status, (await resp.text())[:400]) from None
            if resp.status != 200:
                body = data if isinstance(data, dict) else {}
                error = body.get(
                    "error"
                )  # the server's {"error": {...}}, or the token check's {"error": str}
                message = error.get("message", data) if isinstance(error, dict) else body.get("message", data)
                raise TeacherClientError(resp.status, str(message))
            return data

    async def health(self) -> dict[str, Any]:
        return await self._call("GET", "/health")

    async def score(
        self, input_ids: Sequence[Sequence[int]], response_start: Sequence[int], top_k: int | None = None
    ) -> ScoreResponse:
        """Score rows (prompt + response); see the module docstring for shapes. Binary or JSON on the wire
        (`binary`), the same lists either way."""
        if self.binary:
            return ScoreResponse.from_tensors(await self.score_tensors(input_ids, response_start, top_k))
        body = {
            "input_ids": [list(r) for r in input_ids],
            "response_start": list(response_start),
            "top_k": top_k,
        }
        data = await self._call("POST", "/score", body)
        return ScoreResponse(
            data["logprobs"],
            data.get("topk_ids"),
            data.get("topk_logprobs"),
            data["weight_version"],
            data["fingerprint"],
        )

    async def score_tensors(
        self, input_ids: Sequence[Sequence[int]], response_start: Sequence[int], top_k: int | None = None
    ) -> ScoreTensors:
        """Score rows with binary transport both ways: the answer as packed tensors (`ScoreTensors`:
        logprobs [N] float32, topk_ids [N, K] int32, topk_logprobs [N, K] float32, lengths [B] int64).

        Raises:
            TeacherClientError: an error status (the server's message), or an answer that is not a
                valid frame (status 200, the WireError's message).
        """
        if self._session is None:
            raise RuntimeError("TeacherClient used outside `async with` (no session)")
        body = encode_score_request(input_ids, response_start, top_k)
        async with self._session.post(self.url + "/score", data=body, headers=FRAME_HEADERS) as resp:
            if resp.status == 200 and is_frame(resp):
                try:
                    frame = await read_frame(resp, self.max_body_bytes, self.buffers)
                    return ScoreTensors.from_frame(frame)
                except WireError as err:
                    raise TeacherClientError(resp.status, f"unreadable binary answer: {err}") from None
            text = await resp.text()
            try:
                data = json.loads(text)
            except json.JSONDecodeError:
                raise TeacherClientError(resp.status, text[:400]) from None
            message = data.get("error", {}).get("message", data) if isinstance(data, dict) else data
            if resp.status == 200:
                message = f"expected a binary answer ({resp.content_type} instead): {str(message)[:200]}"
            raise TeacherClientError(resp.status, str(message))

    async def generate_greedy(
        self, input_ids: Sequence[Sequence[int]], max_new_tokens: int, eos_token_id: int, pad_token_id: int
    ) -> list[list[int]]:
        """Greedy new tokens per row, rows of equal length (`teacher_generate.py`)."""
        body = greedy_body(input_ids, max_new_tokens, eos_token_id, pad_token_id)
        return [list(r) for r in (await self._call("POST", "/generate_greedy", body))["output_ids"]]

    async def offload(self) -> dict[str, Any]:
        return await self._call("POST", "/offload")

    async def onload(self) -> dict[str, Any]:
        return await self._call("POST", "/onload")

    async def memory_peaks(self) -> dict[str, Any]:
        """The server's peak GPU memory per phase since the last call (`engines/peak_memory.py`)."""
        return await self._call("POST", "/memory_peaks")

    async def reload(self) -> dict[str, Any]:
        return await self._call("POST", "/reload")
