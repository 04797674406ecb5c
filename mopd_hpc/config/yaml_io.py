"""Strict YAML in, plain YAML out.

PyYAML silently keeps the last of two equal keys (`routes: {math: ..., math: ...}`); a config loader
must not, so loading rejects duplicate keys, naming their YAML path and lines. Loading is bounded
(config/yaml_limits.py: size, depth, alias expansion), so a YAML bomb is an error, not a hang.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import yaml

from mopd_hpc.config.problems import Problem, join_path
from mopd_hpc.config.yaml_limits import DepthLimitedComposer, YamlLimitError, check_expansion, check_text_size


class _Loader(DepthLimitedComposer, yaml.SafeLoader):
    """SafeLoader that also reads `1e-4` (no dot: a string in YAML 1.1) as a float, as YAML 1.2 does."""


class _Dumper(yaml.SafeDumper):
    """SafeDumper that quotes the strings `_Loader` would read as floats (`'0E0'`, `'1e-4'`)."""


_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789"))


def _duplicates(node: yaml.Node, path: tuple[str | int, ...] = ()) -> Iterator[Problem]:
    """Duplicate scalar keys anywhere below `node` (a composed, not yet constructed, YAML node)."""
    if isinstance(node, yaml.MappingNode):
        first: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            line = key_node.start_mark.line + 1
            if key is not None and key in first:
                yield Problem(
                    join_path(*path, key),
                    f"duplicate key (lines {first[key]} and {line}); YAML would silently keep the last",
                    expected="keep one",
                )
            elif key is not None:
                first[key] = line
            yield from _duplicates(value_node, (*path, key if key is not None else "?"))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            yield from _duplicates(item, (*path, i))


def load_yaml_text(text: str) -> tuple[Any, list[Problem]]:
    """Parse YAML text (safe loader). Returns (document, problems).

    A syntax error is one problem naming line and column (document None); so is a text over a limit of
    config/yaml_limits.py (MAX_BYTES, MAX_DEPTH, MAX_NODES: checked before anything walks the document);
    duplicate keys are problems naming their path (the document is still returned, last key winning, so
    validation can go on).
    """
    try:
        check_text_size(text)
    except YamlLimitError as exc:
        return None, [Problem("", str(exc))]
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, []
        check_expansion(node)
        problems = list(_duplicates(node))
        return loader.construct_document(node), problems
    except YamlLimitError as exc:
        return None, [Problem("", str(exc))]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "<yaml>"
        reason = getattr(exc, "problem", None) or str(exc)
        return None, [Problem("", f"YAML syntax error at {where}: {reason}")]
    finally:
        loader.dispose()


def load_yaml_value(text: str) -> Any:
    """One YAML value (`--set` values): a scalar or flow collection, `1e-4` a float.

    Raises:
        yaml.YAMLError: text YAML cannot parse.
        YamlLimitError: text over a limit of config/yaml_limits.py.
    """
    check_text_size(text)
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        check_expansion(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def dump_yaml(data: Any) -> str:
    """Block-style YAML, keys in declaration order, unicode kept where it reads back unchanged.

    PyYAML writes some characters raw that its own reader takes as line breaks (U+0085 NEL inside a
    single-quoted scalar): when the unicode form does not load back equal, every non-ASCII character is
    escaped instead, so `load_yaml_text(dump_yaml(d)) == d` always holds.
    """
    options = dict(sort_keys=False, default_flow_style=False, width=110)
    text = yaml.dump(data, Dumper=_Dumper, allow_unicode=True, **options)
    if load_yaml_text(text)[0] != data:
        text = yaml.dump(data, Dumper=_Dumper, allow_unicode=False, **options)
    return text
