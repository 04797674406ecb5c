"""The teacher scoring server's client (asyncio, aiohttp): `TeacherClient`, its answers and its error.

The routes, the JSON shapes and the error body are the server's (`http_app.py`); the binary frames of
/score are in `score_frames.py`. `score` returns per-row lists (`ScoreResponse`, the same bit for bit over
JSON and binary); `score_tensors` returns the packed tensors of a binary answer (`ScoreTensors`).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

from mopd_hpc.engines.frames.buffer_pool import BufferPool
from mopd_hpc.engines.frames.codec import DEFAULT_MAX_BODY_BYTES, WireError
from mopd_hpc.engines.frames.over_http import FRAME_HEADERS, READ_BUFSIZE, is_frame, read_frame
from mopd_hpc.engines.teacher.greedy_generate import greedy_body
from mopd_hpc.engines.teacher.score_frames import ScoreTensors, encode_score_request
from mopd_hpc.runtime.http_auth import auth_headers
from mopd_hpc.runtime.http_client import SessionClient, within_deadline

#: Default client timeout of one request, in seconds (scoring a large batch on CPU can take a while).
DEFAULT_TIMEOUT_S = 600.0

T = TypeVar("T")


class TeacherClientError(RuntimeError):
    """The teacher server answered with an error status or an unreadable body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"teacher server error {status}: {message}")
        self.status = status


class TeacherUnavailableError(TeacherClientError):
    """No answer from a teacher server: it did not answer within the request timeout (a stopped or hung
    server), or the connection failed (a dead one). The message names the teacher, its URL and the path."""

    def __init__(self, message: str) -> None:
        RuntimeError.__init__(self, message)
        self.status = 0


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


class TeacherClient(SessionClient):
    """asyncio client of one teacher server. Use as `async with TeacherClient(url) as client: ...`.

    Args:
        url: "http://host:port".
        timeout_s: total time allowed per request (connect, send, the server's work, the answer), in
            seconds; past it the request raises TeacherUnavailableError.
        connect_timeout_s: time allowed to connect, in seconds.
        binary: `score` travels as frames (binary transport) when True, as JSON when False; the answer
            is the same, bit for bit. `score_tensors` is always binary.
        max_body_bytes: the largest answer frame accepted, in bytes (larger: TeacherClientError).
        keep_buffers: answer buffers kept for reuse once the tensors of an answer are dropped (0: none);
            each is as large as the largest answer.
        token: the job's token, sent with every request (`runtime/http_auth.py`; a job's server answers 401
            without it); None sends none.
        name: what error messages call this server (the teacher id and replica: `'chain' replica 0`);
            None: `teacher server`.
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
        name: str | None = None,
    ) -> None:
        if timeout_s <= 0 or connect_timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}, connect_timeout_s={connect_timeout_s}: expected > 0")
        self.url = url.rstrip("/")
        self.name = "teacher server" if name is None else f"teacher {name}"
        self.timeout_s = timeout_s
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

    async def _reaching(self, path: str, call: Awaitable[T]) -> T:
        """`call` (a request to `path`) within `timeout_s`, the answer's direct socket read included (aiohttp's
        own total does not cover it); no answer in time or a failed connection raise TeacherUnavailableError."""
        where = f"{self.name} at {self.url}: {path}"
        try:
            return await within_deadline(
                call,
                self.timeout_s,
                where=where,
                field="models.teachers[].request_timeout_s",
                unavailable=TeacherUnavailableError,
            )
        except aiohttp.ClientConnectionError as exc:
            raise TeacherUnavailableError(f"{where}: {type(exc).__name__}: {exc}") from exc

    async def _call(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        if self._session is None:
            raise RuntimeError("TeacherClient used outside `async with` (no session)")
        return await self._reaching(path, self._request(method, path, body))

    async def _request(self, method: str, path: str, body: Any) -> dict[str, Any]:
        assert self._session is not None
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
            TeacherUnavailableError: no answer within `timeout_s`, or the connection failed.
        """
        if self._session is None:
            raise RuntimeError("TeacherClient used outside `async with` (no session)")
        body = encode_score_request(input_ids, response_start, top_k)
        return await self._reaching("/score", self._score_frame(body))

    async def _score_frame(self, body: memoryview) -> ScoreTensors:
        assert self._session is not None
        post = self._session.post(
            self.url + "/score", data=body, headers=FRAME_HEADERS, read_bufsize=READ_BUFSIZE
        )
        async with post as resp:
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
        """Greedy new tokens per row, rows of equal length (`greedy_generate.py`)."""
        body = greedy_body(input_ids, max_new_tokens, eos_token_id, pad_token_id)
        return [list(r) for r in (await self._call("POST", "/generate_greedy", body))["output_ids"]]

    async def offload(self) -> dict[str, Any]:
        return await self._call("POST", "/offload")

    async def onload(self) -> dict[str, Any]:
        return await self._call("POST", "/onload")

    async def memory_peaks(self) -> dict[str, Any]:
        """The server's peak GPU memory per phase since the last call (`engines/memory/peaks.py`)."""
        return await self._call("POST", "/memory_peaks")

    async def reload(self) -> dict[str, Any]:
        return await self._call("POST", "/reload")
