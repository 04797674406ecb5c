"""A local dataset file → the project's jsonl (`{"prompt", "answer", "source"}` per line), with a report.

Readers (`read_rows`), by what the path is:

- `*.jsonl` / `*.json` with one object per line: read as it is;
- `*.parquet`: through `pyarrow.parquet` (the `data` extra: `pip install 'mopd_hpc[data]'`);
- a directory written by `datasets`' `save_to_disk`: its Arrow stream files, in the order its
  `state.json` lists them (`_data_files`), through `pyarrow` (no `datasets` needed); a `DatasetDict`
  directory (`dataset_dict.json`) needs `split`.

Each row's prompt is its `prompt_key` field and its answer its `answer_key` field (defaults: the first of
`PROMPT_KEYS` / `ANSWER_KEYS` the first row has; GSM8K's `question` / `answer`). `final_answer` keeps only
what follows the answer's last `####` (GSM8K's worked solutions end in `#### N`), so `exact` rewards work
on it as well as `math`. The prompt must be a non-empty string; the answer a string or a number (written
as a string). A row that breaks the schema is an error naming the row; duplicates (the same prompt again)
and empty answers are counted and reported, and dropped only when asked.
"""

from __future__ import annotations

import json
import numbers
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mopd_hpc.data.errors import DataSourceError

PROMPT_KEYS: tuple[str, ...] = ("prompt", "question", "problem", "query", "input")
ANSWER_KEYS: tuple[str, ...] = ("answer", "solution", "response", "output", "target")
GSM8K_MARK = "####"
#: Row numbers shown in a report line before `...`.
SHOWN_ROWS = 5


class ConvertError(DataSourceError):
    """A dataset file that cannot be converted: unreadable, an unknown layout, or a row off the schema."""


@dataclass(frozen=True, slots=True)
class ConvertReport:
    """What a conversion read and wrote.

    Fields:
        rows: rows read. written: rows written.
        duplicates: 0-based row numbers whose prompt an earlier row already had.
        empty_answers: 0-based row numbers whose answer is empty (after `final_answer`, stripped).
        prompt_key, answer_key: the fields read.
    """

    rows: int
    written: int
    duplicates: tuple[int, ...]
    empty_answers: tuple[int, ...]
    prompt_key: str
    answer_key: str

    def lines(self, wrote: bool = True) -> list[str]:
        """The report in words, one fact a line; `wrote=False` (`mopd-data check`, which writes nothing) says
        `rows checked: N` (every row read) where a conversion says `rows written: N`."""
        return [
            f"rows read: {self.rows} (prompt from {self.prompt_key!r}, answer from {self.answer_key!r})",
            f"rows written: {self.written}" if wrote else f"rows checked: {self.rows}",
            f"duplicate prompts: {len(self.duplicates)}{rows_note(self.duplicates)}",
            f"empty answers: {len(self.empty_answers)}{rows_note(self.empty_answers)}",
        ]


def rows_note(rows: Sequence[int]) -> str:
    """` (rows 1, 3, ...)` for a report line; empty for no rows."""
    if not rows:
        return ""
    shown = ", ".join(map(str, rows[:SHOWN_ROWS]))
    return f" (rows {shown}{', ...' if len(rows) > SHOWN_ROWS else ''})"


def read_rows(path: str | os.PathLike[str], split: str | None = None) -> list[dict[str, Any]]:
    """The rows of a jsonl file, a parquet file or a `save_to_disk` directory (module docstring).

    Raises:
        ConvertError: missing path, unknown suffix, unreadable file, a jsonl line that is not a JSON
            object (named by its line), pyarrow missing, a DatasetDict without `split` or an unknown one.
    """
    p = Path(path)
    if p.is_dir():
        return _read_saved(p, split)
    if not p.is_file():
        raise ConvertError(f"{p}: no such file or directory")
    if p.suffix in (".jsonl", ".json"):
        return list(_read_jsonl(p))
    if p.suffix == ".parquet":
        pq = _pyarrow("parquet")
        try:
            return pq.read_table(p).to_pylist()
        except Exception as exc:  # pyarrow's ArrowInvalid / OSError on a damaged file
            raise ConvertError(f"{p}: not a readable parquet file: {exc}") from exc
    raise ConvertError(
        f"{p}: unknown file type {p.suffix!r}; expected .jsonl, .json (one object per line), .parquet, "
        "or a directory written by datasets' save_to_disk"
    )


def _read_jsonl(p: Path) -> Iterator[dict[str, Any]]:
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConvertError(f"{p}: cannot read: {exc}") from exc
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConvertError(f"{p}:{line_no}: not valid JSON ({exc.msg} at column {exc.colno})") from exc
        if not isinstance(obj, dict):
            raise ConvertError(f"{p}:{line_no}: expected a JSON object (got {type(obj).__name__})")
        yield obj


def _read_saved(p: Path, split: str | None) -> list[dict[str, Any]]:
    if (p / "dataset_dict.json").is_file():
        splits = json.loads((p / "dataset_dict.json").read_text()).get("splits", [])
        if split not in splits:
            raise ConvertError(f"{p}: a DatasetDict; --split must name one of {splits} (got {split!r})")
        p = p / split
    elif split is not None:
        raise ConvertError(
            f"{p}: --split {split!r} given, but this directory holds one dataset, not a DatasetDict"
        )
    try:
        files = [f["filename"] for f in json.loads((p / "state.json").read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConvertError(
            f"{p}: not a directory written by datasets' save_to_disk (state.json with _data_files: {exc})"
        ) from exc
    pa = _pyarrow("")
    rows: list[dict[str, Any]] = []
    for name in files:
        try:
            with pa.memory_map(str(p / name)) as source:
                rows.extend(pa.ipc.open_stream(source).read_all().to_pylist())
        except Exception as exc:  # pyarrow's ArrowInvalid, a missing shard
            raise ConvertError(f"{p / name}: not a readable Arrow stream file: {exc}") from exc
    return rows


def _pyarrow(module: str) -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError as exc:
        raise ConvertError(
            "reading parquet and save_to_disk directories needs pyarrow: pip install 'mopd_hpc[data]' "
            "(or pip install pyarrow), or convert the file to jsonl first"
        ) from exc
    return pyarrow.parquet if module == "parquet" else pyarrow


def pick_key(row: Mapping[str, Any], given: str | None, candidates: Sequence[str], what: str) -> str:
    """`given`, or the first of `candidates` that `row` has.

    Raises:
        ConvertError: `given` is not a field of the row, or none of the candidates is.
    """
    if given is not None:
        if given not in row:
            raise ConvertError(f"--{what}-key {given!r}: not a field of the rows (fields: {sorted(row)})")
        return given
    for key in candidates:
        if key in row:
            return key
    raise ConvertError(
        f"no {what} field: the rows have {sorted(row)}, none of {list(candidates)}; name it with --{what}-key"
    )


def convert_rows(
    rows: Sequence[Mapping[str, Any]],
    source: str,
    *,
    prompt_key: str | None = None,
    answer_key: str | None = None,
    final_answer: bool = False,
    drop_duplicates: bool = False,
    drop_empty: bool = False,
) -> tuple[list[dict[str, str]], ConvertReport]:
    """The project's rows `{"prompt", "answer", "source"}` and the report (module docstring).

    Raises:
        ConvertError: no rows; a missing field; a prompt that is not a non-empty string or an answer that
            is neither a string nor a number (named by its 0-based row number and field).
    """
    if not rows:
        raise ConvertError("the dataset has no rows")
    pkey = pick_key(rows[0], prompt_key, PROMPT_KEYS, "prompt")
    akey = pick_key(rows[0], answer_key, ANSWER_KEYS, "answer")
    out: list[dict[str, str]] = []
    seen: set[str] = set()
    duplicates, empty = [], []
    for i, row in enumerate(rows):
        prompt, answer = row.get(pkey), row.get(akey)
        if not isinstance(prompt, str) or not prompt.strip():
            raise ConvertError(f"row {i}: field {pkey!r} must be a non-empty string (got {prompt!r})")
        if isinstance(answer, numbers.Number) and not isinstance(answer, bool):
            answer = str(answer)
        if not isinstance(answer, str):
            raise ConvertError(f"row {i}: field {akey!r} must be a string or a number (got {answer!r})")
        if final_answer and GSM8K_MARK in answer:
            answer = answer.rsplit(GSM8K_MARK, 1)[1]
        answer = answer.strip() if final_answer else answer
        duplicate, blank = prompt in seen, not answer.strip()
        seen.add(prompt)
        if duplicate:
            duplicates.append(i)
        if blank:
            empty.append(i)
        if (duplicate and drop_duplicates) or (blank and drop_empty):
            continue
        out.append({"prompt": prompt, "answer": answer, "source": source})
    report = ConvertReport(len(rows), len(out), tuple(duplicates), tuple(empty), pkey, akey)
    return out, report


def to_jsonl(rows: Sequence[Mapping[str, Any]]) -> str:
    """One JSON object a line (UTF-8 kept as it is), newline-terminated."""
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
