"""Validation of JSON request fields: each failure names the field, the value and what was expected.

Shared by the request records of the rollout surface (`rollout/protocol.py`, `rollout/control.py`) and of
weight sync (`weight_sync/requests.py`, `weight_sync/ipc.py`); no torch, no aiohttp.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any


class RolloutRequestError(ValueError):
    """A rollout request is malformed: a field has the wrong type or value (HTTP 400)."""


def fail(field: str, value: Any, expected: str) -> RolloutRequestError:
    return RolloutRequestError(f"{field}={value!r}: expected {expected}")


def int_field(field: str, value: Any, lo: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise fail(field, value, "an integer")
    if lo is not None and value < lo:
        raise fail(field, value, f"an integer >= {lo}")
    return value


def float_field(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise fail(field, value, "a finite number")
    return float(value)


def bool_field(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise fail(field, value, "true or false")
    return value


def str_field(field: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise fail(field, value, "a non-empty string")
    return value


def json_object(what: str, body: Any) -> Mapping[str, Any]:
    if body is None:
        return {}
    if not isinstance(body, Mapping):
        raise fail(what, body, "a JSON object")
    return body


def reject_unknown(what: str, body: Mapping[str, Any], known: Sequence[str]) -> None:
    unknown = sorted(set(body) - set(known))
    if unknown:
        raise RolloutRequestError(f"{what}: unsupported field(s) {unknown}; supported: {sorted(known)}")
