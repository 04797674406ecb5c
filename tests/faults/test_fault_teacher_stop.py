"""Fault: SIGSTOP of a teacher server mid-run (a hung node, a debugger, a stopped job step).

Kept: the step that needs the teacher fails once its request has waited `models.teachers[].request_timeout_s`
(here `TIMEOUT_S`), at most `STEP_S` later than that, or as much earlier when the /score was in flight at
the stop (a /score starts at most one step before or after it; a step of the micro models takes about 2 s on
2 shared cores); the actor's error names
the teacher, the replica and its URL (the endpoint record's); the job ends within `TIMEOUT_S + MARGIN_S` of
the stop (the actor's exit, then the guard stops the others, the stopped teacher included: SIGTERM, then
SIGCONT so that it acts on it; measured: 11 s to the actor's exit, 18 s to the guard's, 23 s to mopd-submit's);
no process of the job is left; the summary says FAILED. Without the timeout the step waited 600 s.
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

from mopd_hpc.engines.teacher.client import TeacherClient, TeacherUnavailableError

TIMEOUT_S = 4.0
STEP_S = 6.0


def set_teacher_timeouts(doc: dict, timeout_s: float) -> None:
    for teacher in doc["models"]["teachers"]:
        teacher["request_timeout_s"] = timeout_s


def test_sigstop_of_a_teacher_fails_the_step_within_its_timeout_naming_it(micro_models, tmp_path):  # noqa: F811
    run = stop_mid_run(
        micro_models, tmp_path, ("teacher", 0), "teacher-chain.r0.json", TIMEOUT_S, set_teacher_timeouts
    )
    want = f"teacher 'chain' replica 0 at {run.url}: /score: no answer within {TIMEOUT_S:g} s"
    assert_failed_within_timeout(run, TIMEOUT_S, STEP_S, re.escape(want))


@pytest.mark.parametrize("sends", [b"", STALLED_FRAME], ids=["silent", "stalls-mid-answer"])
def test_a_silent_or_stalled_server_is_a_timeout_naming_the_teacher(sends: bytes) -> None:
    """A listener that accepts and never answers, or stalls after the head of a 2 MiB frame answer (read
    straight from the socket, outside aiohttp's own timeout): TeacherUnavailableError within the timeout."""

    async def score(url: str) -> None:
        async with TeacherClient(url, timeout_s=1.0, name="'chain' replica 0") as client:
            await client.score_tensors([[1, 2, 3]], [1])

    url, message = hung_call_error(sends, score, TeacherUnavailableError)
    assert message.startswith(f"teacher 'chain' replica 0 at {url}: /score: no answer within 1 s")


def test_a_dead_server_is_named() -> None:
    url = closed_url()

    async def score() -> None:
        async with TeacherClient(url, timeout_s=5.0, name="'legs' replica 1") as client:
            await client.score_tensors([[1, 2, 3]], [1])

    with pytest.raises(TeacherUnavailableError, match=rf"^teacher 'legs' replica 1 at {url}: /score: Client"):
        asyncio.run(score())
