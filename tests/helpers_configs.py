"""Config documents for tests: dotted-key edits of a YAML mapping."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def set_dotted(doc: dict[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """Set each "a.b.c" key of `changes` in `doc` (nested dicts, keys must exist up to the last); returns doc."""
    for key, value in changes.items():
        *head, last = key.split(".")
        node = doc
        for part in head:
            node = node[part]
        node[last] = value
    return doc
