"""Config problems: one record per thing wrong, and the error that lists them all.

Every problem renders as `<yaml.path>: <what is wrong> (got <value>; <expected / known values>)`, e.g.
`routes.math: unknown teacher 'reasoner' (known: solver, counter)` (STYLE.md rule 8: the field, the
value, what was expected, the way out). Validators that check more than one field raise `RuleViolation`
with paths relative to their section; the loader prefixes the section's path and collects everything
into one `ConfigError`, so a user fixes a config in one pass, not one error per run.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

#: Sentinel for "no value to show" (distinct from a value of None, which shows as `null`).
NO_VALUE: object = object()
#: Longest rendering of an offending value before it is cut (characters).
MAX_VALUE_CHARS = 80


def show(value: object) -> str:
    """Render a value the way the user wrote it in YAML: `null`, `true`, `'text'`, `3`, `[1, 2]`."""
    if value is None:
        text = "null"
    elif isinstance(value, bool):
        text = "true" if value else "false"
    else:
        text = repr(value)
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 3] + "..."


def join_path(*parts: str | int) -> str:
    """Dotted YAML path with list indices: ("data", "sources", 1, "route") → `data.sources[1].route`."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part:
            out = f"{out}.{part}" if out else str(part)
    return out


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong in a config.

    Attributes:
        path: dotted YAML path (`data.sources[1].route`); relative to a section inside a section
            validator, absolute once the loader has prefixed it; "" is the document root.
        message: what is wrong, in the field's terms.
        got: the offending value, or NO_VALUE when there is none to show (a missing key).
        expected: what would be right, the known values, or the way out; "" for none.
        unverified: "" for a problem that stands; for a setting whose code is written (and tested on CPU)
            but has not run on GPUs here, the GPU test that has not run: `allow_unverified: true` turns it
            into a warning (config/capabilities.py).
    """

    path: str
    message: str
    got: object = NO_VALUE
    expected: str = ""
    unverified: str = ""

    def under(self, prefix: str) -> Problem:
        """The same problem with its path placed under `prefix` (a section path)."""
        if not prefix:
            return self
        if not self.path:
            path = prefix
        elif self.path.startswith("["):
            path = prefix + self.path
        else:
            path = f"{prefix}.{self.path}"
        return replace(self, path=path)

    def render(self) -> str:
        details = []
        if self.got is not NO_VALUE:
            details.append(f"got {show(self.got)}")
        if self.expected:
            details.append(self.expected)
        tail = f" ({'; '.join(details)})" if details else ""
        return f"{self.path}: {self.message}{tail}" if self.path else f"{self.message}{tail}"


def needs_gpus(path: str, what: str, value: object, group_path: str, way_out: str = "use 1") -> Problem:
    """`what` (at `path`, set to `value`) cannot run on the group at `group_path`, which has no GPUs."""
    return Problem(
        path,
        f"{what} needs GPUs, but {group_path}.gpus_per_node is 0",
        value,
        f"{way_out}, or give the group GPUs",
    )


class RuleViolation(ValueError):
    """Raised by a cross-field validator; carries every problem it found (paths relative to its section)."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems = tuple(problems)
        super().__init__("; ".join(p.render() for p in self.problems))


def raise_if_any(problems: Iterable[Problem]) -> None:
    """Raise `RuleViolation` when `problems` is not empty."""
    found = list(problems)
    if found:
        raise RuleViolation(found)


class ConfigError(ValueError):
    """A run config that cannot run. The message lists every problem, one per line.

    Attributes:
        problems: each problem, paths absolute (from the document root).
        source: where the config came from (a file path, `<string>`, `<dict>`).
    """

    def __init__(self, problems: Sequence[Problem], source: str = "<config>") -> None:
        self.problems = tuple(problems)
        self.source = source
        count = len(self.problems)
        head = f"{source}: {count} problem{'s' if count != 1 else ''}"
        super().__init__("\n".join([head, *(f"  - {p.render()}" for p in self.problems)]))


def known(values: Iterable[object], label: str = "known") -> str:
    """`known: a, b, c` (in the config's order, de-duplicated) or `known: none`."""
    items = list(dict.fromkeys(str(v) for v in values))
    return f"{label}: {', '.join(items) if items else 'none'}"
