"""Base model for every section of the run config: strict, frozen, documented.

Every section forbids unknown keys (a typo is an error naming the key, not a silently ignored knob)
and is frozen (the resolved config is a record that crosses process boundaries unchanged).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A section of the run config (STYLE.md rule 2: extra="forbid", frozen=True)."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
