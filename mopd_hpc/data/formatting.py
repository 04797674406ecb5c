"""Prompt formatting: a reasoning-gym entry → the text the model sees.

The tiny models of this project read short forms (reference/tiny_calibration.md, "Prompts,
shortened"); the completion is the final answer followed by EOS:

    chain_sum      `5+1+8=`                (the expression without spaces, then `=`)
    leg_counting   `3 woodlouses, 1 ant=`  (the dataset's animal list, then `=`)
    anything else  the dataset's own `question`, unchanged

A formatter is a pure function of the entry (`question`, `answer`, `metadata`), so the same entry
always gives the same text.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from mopd_hpc.data.errors import DataSourceError

Formatter = Callable[[Mapping[str, Any]], str]


def format_chain_sum(entry: Mapping[str, Any]) -> str:
    """`{"metadata": {"expression": "5 + 1 + 8"}}` → `5+1+8=`."""
    return _metadata(entry, "chain_sum", "expression").replace(" ", "") + "="


def format_leg_counting(entry: Mapping[str, Any]) -> str:
    """`{"metadata": {"animals": {"woodlouse": 3, "ant": 1}}}` → `3 woodlouses, 1 ant=`.

    The list is rebuilt from the metadata exactly as reasoning-gym writes it in its question
    (insertion order; a plural `s` when the count is above 1), independent of the question template.
    """
    animals = _metadata(entry, "leg_counting", "animals")
    return ", ".join(f"{count} {animal}{'s' if count > 1 else ''}" for animal, count in animals.items()) + "="


def format_question(entry: Mapping[str, Any]) -> str:
    """The generic fallback: the dataset's own question."""
    question = entry.get("question")
    if not isinstance(question, str) or not question:
        raise DataSourceError(f"entry['question']: expected a non-empty str (got {question!r})")
    return question


PROMPT_FORMATTERS: dict[str, Formatter] = {
    "chain_sum": format_chain_sum,
    "leg_counting": format_leg_counting,
}


def format_prompt(task: str, entry: Mapping[str, Any]) -> str:
    """Format a reasoning-gym entry of `task` with its short form, or the question as a fallback."""
    return PROMPT_FORMATTERS.get(task, format_question)(entry)


def _metadata(entry: Mapping[str, Any], task: str, key: str) -> Any:
    try:
        return entry["metadata"][key]
    except (KeyError, TypeError) as exc:
        raise DataSourceError(
            f"{task} entry: metadata[{key!r}] is missing (got entry keys {sorted(entry)}); "
            "is this an entry of that task?"
        ) from exc
