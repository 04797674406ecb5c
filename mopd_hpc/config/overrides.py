"""`--set key=value` overrides on a config mapping, checked against the schema.

    apply_overrides(d, ["loss.correction=mask", "data.sources[1].route=legs", "routes.chain.legs=0.5"])

A key is a dotted path; list items by `[i]` or `.i`. A value is parsed as a YAML scalar or flow
collection (`1` → int, `1e-4` → float, `true`, `null`, `[a, b]`, `{x: 1}`, anything else a string).
A path the schema does not have is an error naming it, the known keys and the closest match; keys
under free-form mappings (`routes.<route>.<teacher>`, `task_args`) are accepted as they are.
"""

from __future__ import annotations

import copy
import difflib
import re
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from mopd_hpc.config import schema
from mopd_hpc.config.problems import ConfigError, Problem, join_path, known
from mopd_hpc.config.yaml_io import load_yaml_value
from mopd_hpc.config.yaml_limits import YamlLimitError

_PART = re.compile(r"([^.\[\]]+)|\[(-?\d+)\]")


def parse_key(key: str) -> list[str | int]:
    """`data.sources[1].route` or `data.sources.1.route` → ['data', 'sources', 1, 'route'].

    Raises:
        ValueError: an empty key or part, or stray brackets.
    """
    parts: list[str | int] = []
    pos = 0
    while pos < len(key):
        if key[pos] == "." and parts:
            pos += 1
        match = _PART.match(key, pos)
        if match is None:
            raise ValueError(f"malformed key {key!r} at character {pos + 1}")
        word, index = match.groups()
        parts.append(int(index) if index is not None else int(word) if word.lstrip("-").isdigit() else word)
        pos = match.end()
    if not parts or key.endswith("."):
        raise ValueError(f"malformed key {key!r}")
    return parts


def parse_value(text: str) -> Any:
    """A YAML scalar or flow collection (`1e-4` too); text that YAML cannot parse stays a string.

    Raises:
        YamlLimitError: text over a limit of config/yaml_limits.py (an alias bomb in a `--set` value).
    """
    try:
        return load_yaml_value(text)
    except yaml.YAMLError:
        return text


def apply_overrides(
    data: Mapping[str, Any] | None, overrides: Iterable[str], root: Any = None
) -> dict[str, Any]:
    """A deep copy of `data` with each `key=value` of `overrides` applied in order.

    Args:
        data: the config mapping as loaded from YAML (not modified).
        overrides: `key=value` strings.
        root: the schema type to check keys against; default RunConfig.
    Raises:
        ConfigError: listing every bad override (`--set <key>: <what> (got ...; known: ...)`).
    """
    out, problems = overrides_applied(data, overrides, root)
    if problems:
        raise ConfigError(problems, "--set")
    return out


def overrides_applied(
    data: Mapping[str, Any] | None, overrides: Iterable[str], root: Any = None
) -> tuple[dict[str, Any], list[Problem]]:
    """`apply_overrides` without raising: (the copy with every good override applied, the bad ones'
    problems), so that validation can still report what is wrong in the rest of the config."""
    if root is None:
        from mopd_hpc.config.run import RunConfig

        root = RunConfig
    out: dict[str, Any] = copy.deepcopy(dict(data)) if data else {}
    problems: list[Problem] = []
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            problems.append(
                Problem(f"--set {item}", "expected KEY=VALUE", expected="e.g. loss.correction=mask")
            )
            continue
        try:
            parts = parse_key(key.strip())
        except ValueError as exc:
            problems.append(
                Problem(f"--set {key}", str(exc), expected="a dotted path such as data.sources[0].route")
            )
            continue
        try:
            value = parse_value(text)
        except YamlLimitError as exc:
            problems.append(Problem(f"--set {key}", str(exc), expected="a short scalar or flow collection"))
            continue
        problem = _set(out, parts, value, root)
        if problem is not None:
            problems.append(problem)
    return out, problems


def _set(data: dict[str, Any], parts: list[str | int], value: Any, root: Any) -> Problem | None:
    """Set data[parts...] = value, creating mappings on the way; a Problem when the path is wrong."""
    node: Any = data
    tp = root
    for depth, part in enumerate(parts):
        here = join_path(*parts[: depth + 1])
        try:
            tp = schema.child(tp, part, node)
        except schema.UnknownKey as exc:
            close = difflib.get_close_matches(str(part), exc.known, n=1)
            hint = known(exc.known) + (f"; did you mean {close[0]!r}?" if close else "")
            return Problem(f"--set {here}", "unknown key", part, hint)
        last = depth == len(parts) - 1
        if isinstance(part, int):
            if not isinstance(node, list) or not -len(node) <= part < len(node):
                size = len(node) if isinstance(node, list) else 0
                return Problem(f"--set {here}", "index out of range", part, f"the list has {size} items")
            if last:
                node[part] = value
                return None
        else:
            if not isinstance(node, dict):
                return Problem(f"--set {here}", "the parent is not a mapping", node)
            if last:
                node[part] = value
                return None
            if node.get(part) is None:
                node[part] = [] if isinstance(parts[depth + 1], int) else {}
        node = node[part]
    return None
