"""Shared field types of the run config: identifiers, dtypes, engine names."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import StringConstraints

#: Ids of models, routes and sources (AReaL feature/mopd's teacher-id rule): they name child processes,
#: log files and metric keys, so they stay short and shell-safe.
IDENTIFIER_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
IDENTIFIER_MAX_CHARS = 64
IDENTIFIER_RULE = "an identifier: letters, digits, '_', '.', '-', starting with a letter or digit, ≤ 64 chars"

Identifier = Annotated[
    str, StringConstraints(pattern=IDENTIFIER_PATTERN, min_length=1, max_length=IDENTIFIER_MAX_CHARS)
]
#: A non-empty string (paths, HF model ids, partitions).
NonEmptyStr = Annotated[str, StringConstraints(min_length=1)]

Dtype = Literal["float32", "bfloat16", "float16"]
#: Train/scoring engine backends (DESIGN.md §5): transformers on CPU/GPU, or megatron-core (GPU only).
Engine = Literal["torch", "megatron"]
