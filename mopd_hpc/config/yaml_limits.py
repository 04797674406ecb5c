"""Bounds on what a YAML config may cost to load: its size, its nesting depth, its alias expansion.

A YAML "bomb" is a few hundred bytes of nested aliases (`a1: [*a0, *a0, ...]`, `a2: [*a1, *a1, ...]`)
that expands to 9^n nodes: PyYAML composes it at once (the aliases are shared nodes), but everything that
walks the document afterwards (the duplicate-key check, validation, rendering a problem) walks the
expansion — 8 levels took 35 s and 10 levels never ended. These limits are far above any real config (the
shipped ones are < 6 kB, depth < 8, < 1000 nodes) and stop a bomb before anything walks it:

- `MAX_BYTES`: the text, in bytes (UTF-8);
- `MAX_DEPTH`: nesting of collections, aliases followed (a recursive alias `&a [*a]` is refused);
- `MAX_NODES`: nodes of the document with every alias expanded (each use of an alias counts its subtree).

The same idea as libyaml-based loaders' alias limits (e.g. Go's yaml.v3 and SnakeYAML's
`maxAliasesForCollections`), counted here on expanded nodes, which bounds the work directly.
"""

from __future__ import annotations

import yaml

#: Largest config text, bytes.
MAX_BYTES = 1 << 20
#: Deepest nesting of mappings and sequences (aliases followed).
MAX_DEPTH = 64
#: Most nodes in the document with every alias expanded.
MAX_NODES = 100_000

_WAY_OUT = "a config needs far less: write the values out instead of nesting aliases"


class YamlLimitError(ValueError):
    """A YAML text over one of the limits; the message names the limit, its value and the line."""


def check_text_size(text: str) -> None:
    """Raises YamlLimitError when `text` is over MAX_BYTES (UTF-8 bytes)."""
    size = len(text.encode("utf-8", errors="surrogatepass"))
    if size > MAX_BYTES:
        raise YamlLimitError(f"YAML text too large: {size} bytes (the limit is {MAX_BYTES} bytes)")


class DepthLimitedComposer:
    """Mix-in for a PyYAML loader: composing a collection nested deeper than MAX_DEPTH raises
    YamlLimitError (PyYAML's composer is recursive: a deep text would otherwise end in RecursionError)."""

    _depth = 0

    def compose_node(self, parent, index):  # type: ignore[no-untyped-def]  # PyYAML's signature
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark  # type: ignore[attr-defined]
                raise YamlLimitError(
                    f"YAML nested too deep at line {mark.line + 1}: more than {MAX_DEPTH} levels "
                    f"(the limit is {MAX_DEPTH})"
                )
            return super().compose_node(parent, index)  # type: ignore[misc]
        finally:
            self._depth -= 1


def check_expansion(root: yaml.Node) -> int:
    """Count the nodes of `root` with every alias expanded. Returns the count (≤ MAX_NODES).

    Linear in the distinct nodes (each shared node's expanded size is computed once).

    Raises:
        YamlLimitError: more than MAX_NODES expanded nodes, more than MAX_DEPTH levels once aliases are
            followed, or a recursive alias (a collection that contains itself).
    """
    seen: dict[int, tuple[int, int]] = {}  # id(node) -> (expanded size, expanded height)
    open_nodes: set[int] = set()

    def too_deep(line: int) -> YamlLimitError:
        return YamlLimitError(
            f"YAML nested too deep at line {line} once aliases are followed: more than {MAX_DEPTH} "
            f"levels (the limit is {MAX_DEPTH}); {_WAY_OUT}"
        )

    def measure(node: yaml.Node, depth: int) -> tuple[int, int]:
        key = id(node)
        if key in seen:
            return seen[key]
        line = node.start_mark.line + 1
        if key in open_nodes:
            raise YamlLimitError(f"YAML recursive alias at line {line}: a collection contains itself")
        if depth > MAX_DEPTH:  # bounds this recursion too
            raise too_deep(line)
        total, height = 1, 1
        if isinstance(node, yaml.CollectionNode):
            open_nodes.add(key)
            children = (
                node.value if isinstance(node, yaml.SequenceNode) else [n for kv in node.value for n in kv]
            )
            for child in children:
                size, child_height = measure(child, depth + 1)
                total, height = total + size, max(height, child_height + 1)
                if total > MAX_NODES:
                    raise YamlLimitError(
                        f"YAML aliases expand to more than {MAX_NODES} nodes (the limit is {MAX_NODES}), "
                        f"counted up to the collection at line {line}; {_WAY_OUT}"
                    )
                if height > MAX_DEPTH:
                    raise too_deep(line)
            open_nodes.discard(key)
        seen[key] = (total, height)
        return total, height

    return measure(root, 1)[0]
