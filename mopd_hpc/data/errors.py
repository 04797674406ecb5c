"""Errors of the data layer: one family per failure (STYLE.md rule 8)."""

from __future__ import annotations


class DataSourceError(ValueError):
    """A dataset source cannot be built or read: unknown task, bad split, bad arguments, bad index."""


class JsonlFormatError(DataSourceError):
    """A line of a user's jsonl prompt file is not `{"prompt": str, "answer": str}`.

    Attributes:
        path: the file.
        line_no: 1-based line number of the bad line.
        fields: the line's field names when it is a JSON object without the schema's fields (a raw dataset's
            row, e.g. GSM8K's question/answer); None otherwise.
    """

    def __init__(self, path: str, line_no: int, problem: str, fields: tuple[str, ...] | None = None) -> None:
        self.path = path
        self.line_no = line_no
        self.fields = fields
        super().__init__(
            f"{path}:{line_no}: {problem} "
            '(expected one JSON object per line: {"prompt": "<text>", "answer": "<text>"})'
        )


class RewardError(DataSourceError):
    """A reward that cannot be used: a scorer raised, or returned NaN, ±inf, a value outside [0, 1] or not a
    number. The message names the source, the row (the prompt's 0-based index) and the reward."""


class PromptRecordError(ValueError):
    """A `Prompt` record (or its serialized form) is malformed."""


class SourceIndexError(DataSourceError, IndexError):
    """An index outside `0 <= index < len(source)` (an IndexError too, so iteration stops at the end)."""
