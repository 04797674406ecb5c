"""pydantic's validation errors → `Problem`s with YAML paths, the offending value and what is expected.

pydantic locates an error by a tuple such as `('data', 'sources', 1, 'jsonl', 'path')`: list indices
become `[1]`, the discriminator tag of a union member (`'jsonl'`) is dropped, dict-key errors
(`'[key]'`) say "key". Unknown keys list the section's known keys and the closest match; missing keys
quote the field's description (its unit and meaning).
"""

from __future__ import annotations

import difflib
import re
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from mopd_hpc.config import schema
from mopd_hpc.config.problems import NO_VALUE, Problem, RuleViolation, join_path, known
from mopd_hpc.config.types import IDENTIFIER_PATTERN, IDENTIFIER_RULE

_PREFIXES = ("Value error, ", "Assertion failed, ")
_TYPE_NAMES = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "a whole number",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
    "finite_number": "a finite number",
}


def _walk(root: Any, data: Any, loc: tuple[str | int, ...]) -> tuple[list[str | int], Any, Any, bool]:
    """Follow `loc` from `root`: (YAML path parts, type of the parent, type at loc, loc ends at a dict key)."""
    parts: list[str | int] = []
    tp, parent = root, None
    is_key = False
    for element in loc:
        if element == "[key]":
            is_key = True
            continue
        member = schema.pick_member(schema.strip(tp), data)
        members = schema.union_members(schema.strip(tp))
        if members and isinstance(element, str) and element in {schema.tag_of(m) for m in members}:
            tp = next(m for m in members if schema.tag_of(m) == element)  # the discriminator tag: not a key
            continue
        parts.append(element)
        parent = member
        try:
            tp = schema.child(member, element, data)
        except schema.UnknownKey:
            tp = schema.FREE
        data = _index(data, element)
    return parts, parent, tp, is_key


def _index(data: Any, key: str | int) -> Any:
    if isinstance(data, dict):
        return data.get(key)
    if isinstance(data, list) and isinstance(key, int) and -len(data) <= key < len(data):
        return data[key]
    return None


def _message(error: ErrorDetails) -> str:
    msg = error["msg"]
    for prefix in _PREFIXES:
        if msg.startswith(prefix):
            return msg[len(prefix) :]
    msg = re.sub(r"^Input should be ", "must be ", msg)
    return msg[0].lower() + msg[1:] if msg else msg


def problem_from_error(root: Any, data: Any, error: ErrorDetails) -> list[Problem]:
    """One pydantic error (loc relative to `root`, the type that validated `data`) → problems."""
    loc = tuple(error["loc"])
    parts, parent, tp, is_key = _walk(root, data, loc)
    path = join_path(*parts)
    kind = error["type"]
    ctx = error.get("ctx") or {}
    got = error.get("input", NO_VALUE)
    cause = ctx.get("error")
    if isinstance(cause, RuleViolation):
        return [p.under(path) for p in cause.problems]
    if kind == "missing":
        description = schema.field_description(parent, parts[-1]) if parts else ""
        return [
            Problem(
                path, "required key is missing", expected=f"expected: {description}" if description else ""
            )
        ]
    if kind == "extra_forbidden":
        key = str(parts[-1])
        keys = schema.known_keys(parent)
        close = difflib.get_close_matches(key, keys, n=1)
        hint = known(keys) + (f"; did you mean {close[0]!r}?" if close else "")
        return [Problem(path, "unknown key", got, hint)]
    if kind == "union_tag_invalid":
        return [
            Problem(
                join_path(*parts, "kind"),
                "unknown kind",
                ctx.get("tag"),
                f"known: {ctx.get('expected_tags')}",
            )
        ]
    if kind == "union_tag_not_found":
        tags = ", ".join(repr(schema.tag_of(m)) for m in schema.union_members(schema.strip(tp)))
        return [Problem(join_path(*parts, "kind"), "required key is missing", expected=f"one of {tags}")]
    if kind == "literal_error":
        return [Problem(path, "unknown value", got, f"known: {ctx.get('expected')}")]
    if kind == "string_pattern_mismatch" and ctx.get("pattern") == IDENTIFIER_PATTERN:
        return [
            Problem(
                path + (" (key)" if is_key else ""), "not a valid name", got, f"expected {IDENTIFIER_RULE}"
            )
        ]
    if kind in _TYPE_NAMES:
        return [Problem(path, "wrong type", got, f"expected {_TYPE_NAMES[kind]}")]
    if isinstance(got, dict) and kind in ("value_error", "assertion_error"):
        got = NO_VALUE  # a section-level rule: the whole section is no value to show
    return [Problem(path + (" (key)" if is_key else ""), _message(error), got)]


def problems_from_validation_error(root: Any, data: Any, exc: ValidationError) -> list[Problem]:
    """Every error of `exc` as problems, in pydantic's order (which follows the document)."""
    out: list[Problem] = []
    for error in exc.errors(include_url=False):
        out.extend(problem_from_error(root, data, error))
    return out
