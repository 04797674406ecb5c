"""Fault: SIGSTOP of the rollout server mid-run (a hung node, a debugger, a stopped job step).

Kept: the step fails once its request to the rollout engine (the step's /generate, or the weight update of
the sync that follows it) has waited `rollout.request_timeout_s` (here `TIMEOUT_S`), at most `STEP_S` later
than that, or as much earlier when the request was in flight at the stop (a request starts at most one step
before or after it; a step of the micro models takes about 2 s on 2 shared cores); the actor's error names
the rollout engine's index and its URL (the endpoint record's); the job ends within `TIMEOUT_S + MARGIN_S`
of the stop (helpers_stop.py); no process of the job is left; the summary says FAILED, without a traceback.
Measured: the step failed 4.0 s and the job ended 11 to 28 s after the stop. Without the field the step waited
600 s (the actor's constant before it).
"""

from __future__ import annotations

import asyncio
import re

import pytest
from helpers_stop import (
    STALLED_FRAME,
    assert_failed_within_timeout,
    closed_url,
    hung_call_error,
    stop_mid_run,
)

from mopd_hpc.engines.rollout.client import RolloutClient, RolloutUnavailableError

TIMEOUT_S = 4.0
STEP_S = 6.0


def set_rollout_timeout(doc: dict, timeout_s: float) -> None:
    doc["rollout"]["request_timeout_s"] = timeout_s


def test_sigstop_of_the_rollout_fails_the_step_within_its_timeout_naming_it(micro_models, tmp_path):  # noqa: F811
    run = stop_mid_run(
        micro_models, tmp_path, ("rollout", 0), "rollout-0.json", TIMEOUT_S, set_rollout_timeout
    )
    want = rf"rollout engine 0 at {re.escape(run.url)}: POST /\w+: no answer within {TIMEOUT_S:g} s"
    assert_failed_within_timeout(run, TIMEOUT_S, STEP_S, want)


@pytest.mark.parametrize("sends", [b"", STALLED_FRAME], ids=["silent", "stalls-mid-answer"])
def test_a_silent_or_stalled_server_is_a_timeout_naming_the_engine(sends: bytes) -> None:
    """A listener that accepts and never answers, or stalls after the head of a 2 MiB frame answer (read
    straight from the socket, outside aiohttp's own timeout): RolloutUnavailableError within the timeout."""

    async def generate(url: str) -> None:
        async with RolloutClient(url, timeout_s=1.0, name="engine 1") as client:
            await client.generate_batch({"input_ids": [[1, 2, 3]], "sampling_params": {}})

    url, message = hung_call_error(sends, generate, RolloutUnavailableError)
    assert message.startswith(f"rollout engine 1 at {url}: POST /generate: no answer within 1 s")


def test_a_dead_server_is_named() -> None:
    url = closed_url()

    async def generate() -> None:
        async with RolloutClient(url, timeout_s=5.0, name="engine 0", retry_backoff_s=0.01) as client:
            await client.generate_batch({"input_ids": [[1, 2, 3]], "sampling_params": {}})

    with pytest.raises(
        RolloutUnavailableError, match=rf"^rollout engine 0 at {url}: POST /generate: unreach"
    ):
        asyncio.run(generate())
