"""Polling for tests that wait on real processes, sockets and Slurm: `wait_for` returns the first truthy
value of `pred()`, or fails the test naming what it waited for; `until` says whether `pred()` came true in time
(for `assert until(...), what_went_wrong`)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest


def wait_for(pred: Callable[[], object], timeout_s: float, what: str, step_s: float = 0.1) -> object:
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(step_s)


def until(pred: Callable[[], object], timeout_s: float, step_s: float = 0.1) -> bool:
    """Poll `pred()` every `step_s` s until it is truthy (True) or `timeout_s` s have passed (False)."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(step_s)
    return True
