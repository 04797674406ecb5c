"""`RolloutClient`: the trainer's asyncio client of a rollout server (hf or SGLang, same HTTP surface).

Timeouts and retries: every call has a total timeout (`timeout_s`, seconds; the actor's is
`rollout.request_timeout_s`) that bounds the whole call, its retries and the reading of the answer included
(a frame read straight from the socket too), and a connect timeout. A call that could not reach the server
(connection refused; for GET also reset) is retried up to `retries` times with exponential backoff from
`retry_backoff_s` while the total allows; a 503 answer is retried for the idempotent GET endpoints only. A
non-2xx answer raises `RolloutServerError` carrying the status and the server's message; no answer within
the total, a failed connection or exhausted retries raise `RolloutUnavailableError` naming the server
(`name`: e.g. "engine 0", the actor's rollout engine index) and its URL. Every request carries the job's token
(`token`, as `Authorization: Bearer`; `runtime/http_auth.py`): without it a job's server answers 401.

Binary transport (DESIGN.md §7): with `binary=True` (the default) `generate` and `generate_batch` ask for
the answer as one frame (`generate_wire.py`), and accept SGLang's JSON from a server that answers JSON
(a real SGLang server): the samples are the same, bit for bit. `generate_raw` always speaks SGLang JSON.

    async with RolloutClient("http://127.0.0.1:30000") as client:
        samples = await client.generate([[1, 2, 3]], SamplingParams(max_new_tokens=16, n=4))
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

from mopd_hpc.engines.frames.codec import DEFAULT_MAX_BODY_BYTES, Frame, WireError
from mopd_hpc.engines.frames.over_http import ACCEPT_HEADERS, is_frame, read_frame
from mopd_hpc.engines.rollout.generate_wire import GeneratedBatch
from mopd_hpc.engines.rollout.protocol import GeneratedSample, SamplingParams
from mopd_hpc.engines.weight_sync.requests import (
    DEFAULT_GROUP_NAME,
    DistributedUpdateRequest,
    InitGroupRequest,
)
from mopd_hpc.runtime.http_auth import auth_headers
from mopd_hpc.runtime.http_client import SessionClient, within_deadline

log = logging.getLogger(__name__)

#: The least total timeout of `awex_update`, seconds: it waits for the actor's train step and publish.
AWEX_UPDATE_TIMEOUT_S = 600.0


class RolloutServerError(RuntimeError):
    """The server answered with an error status; `status` and `message` are the server's."""

    def __init__(self, method: str, url: str, status: int, message: str) -> None:
        super().__init__(f"{method} {url} -> {status}: {message}")
        self.status, self.message, self.url = status, message, url


class RolloutUnavailableError(RuntimeError):
    """The server could not be reached within the retries (connection refused, reset), or gave no answer
    within the call's total timeout (stopped, hung, overloaded); the message names the server and its URL."""


class RolloutClient(SessionClient):
    """Async client of one rollout server. Use as `async with`, or call `close()` when done.

    `binary`: ask /generate for a frame (module docstring); `max_body_bytes`: the largest frame accepted,
    in bytes (larger: RolloutServerError); `name`: how errors name the server ("engine 0" → "rollout engine
    0 at URL: ..."; None: "rollout server at URL: ...").

    Raises:
        ValueError: a timeout <= 0 or negative retries.
    """

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        retries: int = 3,
        retry_backoff_s: float = 0.5,
        binary: bool = True,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        name: str | None = None,
    ) -> None:
        if retries < 0 or timeout_s <= 0 or connect_timeout_s <= 0 or retry_backoff_s < 0:
            raise ValueError(
                f"timeout_s={timeout_s}, connect_timeout_s={connect_timeout_s}, retries={retries}, "
                f"retry_backoff_s={retry_backoff_s}: expected positive timeouts and non-negative retries"
            )
        self.base_url = base_url.rstrip("/")
        self.name = "rollout server" if name is None else f"rollout {name}"
        self._headers = auth_headers(token)  # the job's token (None: a server outside the job)
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, connect=connect_timeout_s)
        self.retries, self.retry_backoff_s = retries, retry_backoff_s
        self.binary, self.max_body_bytes = binary, max_body_bytes
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> RolloutClient:
        return self

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        retry_503: bool = False,
        timeout: aiohttp.ClientTimeout | None = None,
        accept_frame: bool = False,
    ) -> Any:
        """Send one request; returns the decoded JSON body (None for an empty body), or the `wire.Frame`
        when `accept_frame` asked for one and the server answered one. `timeout` replaces the client's for
        this request; its total bounds the whole call (retries and the answer's reading included).

        Raises:
            RolloutServerError: an error status (the server's message), or a frame that does not decode.
            RolloutUnavailableError: no answer within the total, a failed connection, or exhausted retries;
                the message names the server (`name`) and its URL.
        """
        timeout = self.timeout if timeout is None else timeout
        return await within_deadline(  # total None: unbounded (a caller's own ClientTimeout without a total)
            self._attempts(method, path, body, retry_503, timeout, accept_frame),
            timeout.total,
            where=f"{self.name} at {self.base_url}: {method} {path}",
            field="rollout.request_timeout_s",
            unavailable=RolloutUnavailableError,
        )

    async def _attempts(
        self,
        method: str,
        path: str,
        body: Any,
        retry_503: bool,
        timeout: aiohttp.ClientTimeout,
        accept_frame: bool,
    ) -> Any:
        """`request`'s attempts, unbounded in total (the caller bounds them)."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout, headers=self._headers)
        url = f"{self.base_url}{path}"
        last: BaseException | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.retry_backoff_s * 2 ** (attempt - 1))
            try:
                async with self._session.request(
                    method,
                    url,
                    json=body,
                    timeout=timeout,
                    headers=ACCEPT_HEADERS if accept_frame else None,
                ) as resp:
                    if accept_frame and resp.status < 400 and is_frame(resp):
                        try:
                            return await read_frame(resp, self.max_body_bytes)
                        except WireError as exc:
                            raise RolloutServerError(
                                method, url, resp.status, f"unreadable frame: {exc}"
                            ) from None
                    text = await resp.text()
                    if resp.status == 503 and retry_503 and attempt < self.retries:
                        last = RolloutServerError(method, url, resp.status, text)
                        continue
                    if resp.status >= 400:
                        raise RolloutServerError(method, url, resp.status, _message(text))
                    return await resp.json(content_type=None) if text.strip() else None
            except aiohttp.ClientConnectionError as exc:
                if isinstance(exc, TimeoutError):  # aiohttp's ServerTimeoutError: `request` names it
                    raise
                if method != "GET" and not isinstance(exc, aiohttp.ClientConnectorError):
                    # the request may have reached the server: a retry could run it twice
                    raise RolloutUnavailableError(
                        f"{self.name} at {self.base_url}: {method} {path}: {type(exc).__name__}: {exc}"
                    ) from exc
                last = exc
                log.debug("%s %s attempt %d failed: %s", method, url, attempt + 1, exc)
        raise RolloutUnavailableError(
            f"{self.name} at {self.base_url}: {method} {path}: unreachable after {self.retries + 1} "
            f"attempts: {last}"
        )

    # ---- generation --------------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: Sequence[Sequence[int]],
        sampling: SamplingParams,
        *,
        return_logprob: bool = True,
        rids: Sequence[str] | None = None,
        return_routed_experts: bool = False,
    ) -> list[GeneratedSample]:
        """Generate for a batch of prompts; returns prompt-major samples (copy j of prompt i at i·n + j);
        `return_routed_experts`: each sample's `routed_experts` (an MoE model; rollout routing replay).

        Raises:
            RolloutRequestError: the answer does not hold len(input_ids) × n items, or is malformed.
        """
        body: dict[str, Any] = {
            "input_ids": [list(p) for p in input_ids],
            "sampling_params": sampling.to_json(),
            "return_logprob": return_logprob,
        }
        if rids is not None:
            body["rid"] = list(rids)
        if return_routed_experts:
            body["return_routed_experts"] = True
        return (await self.generate_batch(body)).samples(input_ids, sampling.n)

    async def generate_batch(self, body: dict[str, Any]) -> GeneratedBatch:
        """POST /generate with an SGLang-shaped body; the answer as a `GeneratedBatch` (ids and log-probs
        as tensors), over binary transport when `binary` and the server offers it, else from its JSON.
        `.samples(prompts, n)` gives the trainer's samples, `.to_sglang()` the JSON answer.

        Raises:
            RolloutServerError: an error status, or a frame that does not decode (the WireError's message).
        """
        out = await self.request("POST", "/generate", body, accept_frame=self.binary)
        if isinstance(out, Frame):
            try:
                return GeneratedBatch.from_frame(out)
            except WireError as exc:
                raise RolloutServerError(
                    "POST", f"{self.base_url}/generate", 200, f"bad frame: {exc}"
                ) from None
        return GeneratedBatch.from_sglang(out)

    async def generate_raw(self, body: dict[str, Any]) -> Any:
        """POST /generate with an SGLang-shaped body; returns the SGLang-shaped response (dict or list)."""
        return await self.request("POST", "/generate", body)

    # ---- state -------------------------------------------------------------------------------------

    async def health(self) -> bool:
        """True when GET /health answers 200; False when it answers otherwise or is unreachable."""
        try:
            await self.request("GET", "/health")
            return True
        except (RolloutServerError, RolloutUnavailableError):
            return False

    async def wait_ready(self, timeout_s: float, poll_s: float = 0.2) -> None:
        """Poll /health until 200; raises RolloutUnavailableError after timeout_s seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not await self.health():
            if loop.time() > deadline:
                raise RolloutUnavailableError(f"{self.base_url}/health: not ready after {timeout_s}s")
            await asyncio.sleep(poll_s)

    async def model_info(self) -> dict[str, Any]:
        return await self.request("GET", "/model_info", retry_503=True)

    async def server_info(self) -> dict[str, Any]:
        return await self.request("GET", "/server_info", retry_503=True)

    async def pause(self, mode: str = "abort") -> None:
        """POST /pause_generation: mode "abort" (SGLang's default), "retract" or "in_place"."""
        await self.request("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        """POST /continue_generation."""
        await self.request("POST", "/continue_generation", {})

    async def release(self, tags: Sequence[str] | None = None) -> dict[str, Any]:
        """POST /release_memory_occupation; tags None = all of kv_cache, weights, cuda_graph."""
        return await self.request(
            "POST", "/release_memory_occupation", {"tags": None if tags is None else list(tags)}
        )

    async def resume_memory(self, tags: Sequence[str] | None = None) -> dict[str, Any]:
        """POST /resume_memory_occupation; a tag that was not released → RolloutServerError(400)."""
        return await self.request(
            "POST", "/resume_memory_occupation", {"tags": None if tags is None else list(tags)}
        )

    # ---- weights -----------------------------------------------------------------------------------

    async def init_weights_update_group(self, req: InitGroupRequest) -> dict[str, Any]:
        """POST /init_weights_update_group; returns once the server joined (the trainer joins meanwhile)."""
        return await self.request("POST", "/init_weights_update_group", req.to_json())

    async def update_weights_from_distributed(self, req: DistributedUpdateRequest) -> dict[str, Any]:
        """POST /update_weights_from_distributed; returns after the server received and loaded the tensors."""
        return await self.request("POST", "/update_weights_from_distributed", req.to_json())

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP_NAME) -> dict[str, Any]:
        return await self.request("POST", "/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"model_path": model_path}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return await self.request("POST", "/update_weights_from_disk", body)

    async def update_weights_from_ipc(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """POST /update_weights_from_ipc (`IpcUpdateRequest.to_json()`); returns after the server copied the
        shared buffers into its weights: {"success", "weight_version", "seconds": {"map", "copy"}}.

        Raises:
            RolloutServerError: 400 a bad handle, or a weight the model does not have or of another shape
                (named; nothing was loaded).
        """
        return await self.request("POST", "/update_weights_from_ipc", dict(body))

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        """POST /get_weights_by_name: the first `truncate_size` elements of parameter `name`, flattened."""
        return await self.request(
            "POST", "/get_weights_by_name", {"name": name, "truncate_size": truncate_size}
        )

    async def memory_peaks(self) -> dict[str, Any]:
        """The engine's peak GPU memory per phase since the last call (`engines/memory/peaks.py`; {} on CPU)."""
        return await self.request("POST", "/memory_peaks")

    async def awex_init(self, inference_config: Mapping[str, Any]) -> dict[str, Any]:
        """POST /awex/init: the server builds and initializes its AWEX reader from `inference_config`
        (`AwexJobConfig.inference_config(engine_rank)`). Returns {"status": "ok", "engine_rank": i} (plus
        "already": true when it was initialized with this same config).

        Raises:
            RolloutServerError: 409 initialized with another config (the message names the keys); 400 the
                config is refused (AwexConfigError); 503 awex is not installed on the server; 500 other.
        """
        return await self.request("POST", "/awex/init", {"inference_config": dict(inference_config)})

    async def awex_update(self, step: int) -> dict[str, Any]:
        """POST /awex/update_weights: returns once the server received step `step`'s weights from the
        actor's AWEX writer (it blocks until the writer publishes; timeout: the client's, at least
        AWEX_UPDATE_TIMEOUT_S). Returns {"status": "ok", "weight_version": str(step), "seconds": float}.

        Raises:
            RolloutServerError: 409 before a successful awex_init or while another update runs; 400 a
                step that is not an integer >= 0; 500 the update failed (the message names the error).
        """
        total = max(self.timeout.total or 0.0, AWEX_UPDATE_TIMEOUT_S)
        timeout = aiohttp.ClientTimeout(total=total, connect=self.timeout.connect)
        return await self.request("POST", "/awex/update_weights", {"step": step}, timeout=timeout)


def _message(text: str) -> str:
    """The server's error message from a JSON error body, else the raw text."""
    import json

    try:
        body = json.loads(text)
    except ValueError:
        return text
    if isinstance(body, dict):
        return str(body.get("message") or body.get("error", {}).get("message") or text)
    return text
