"""Slurm hostlists and task-count lists, in pure Python (no `scontrol` needed).

`scontrol show hostnames` is often missing inside containers (NVIDIA/pyxis#129), so the node lists
Slurm exports (`SLURM_STEP_NODELIST`, `SLURM_JOB_NODELIST_HET_GROUP_<n>`) are expanded here.

Grammar (Slurm `src/common/hostlist.c`, as documented in `scontrol(1)`):
    hostlist := host_expr ("," host_expr)*          commas inside brackets do not split
    host_expr := (literal | "[" range ("," range)* "]")+
    range     := NUMBER | NUMBER "-" NUMBER          zero padding: the width of the lower bound
Several bracket groups in one name expand as a cartesian product, leftmost group outermost:
`r[1-2]n[1-2]` → r1n1, r1n2, r2n1, r2n2. Order and duplicates are kept.

Task-count lists (`SLURM_TASKS_PER_NODE`, `SLURM_JOB_CPUS_PER_NODE`) use `COUNT(xREPEAT)` items:
`2(x3),1` → [2, 2, 2, 1].
"""

from __future__ import annotations

import re
from collections.abc import Sequence

#: Refuse to expand more names than this (a typo like `n[1-999999999]` would exhaust memory).
MAX_HOSTS = 1_000_000

_RANGE_RE = re.compile(r"^(\d+)(?:-(\d+))?$")
_BRACKET_RE = re.compile(r"\[([^\]]*)\]")
_COUNT_RE = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")
_LAST_NUMBER_RE = re.compile(r"^(.*?)(\d+)(\D*)$")


class HostlistError(ValueError):
    """A hostlist or task-count list that does not parse; the message quotes the whole input."""


def _split_top_level(expr: str) -> list[str]:
    """Split `expr` at commas outside brackets; raise on unbalanced or nested brackets."""
    parts: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(expr):
        if ch == "[":
            if depth:
                raise HostlistError(f"hostlist {expr!r}: nested '[' at offset {i}; brackets do not nest")
            depth = 1
        elif ch == "]":
            if not depth:
                raise HostlistError(f"hostlist {expr!r}: ']' without '[' at offset {i}")
            depth = 0
        elif ch == "," and not depth:
            parts.append(expr[start:i])
            start = i + 1
    if depth:
        raise HostlistError(f"hostlist {expr!r}: unbalanced '[' (no closing ']')")
    parts.append(expr[start:])
    return parts


def _expand_ranges(expr: str, body: str) -> list[str]:
    """Expand the inside of one bracket group (`01-04,07`) into zero-padded number strings."""
    numbers: list[str] = []
    for item in body.split(","):
        m = _RANGE_RE.match(item.strip())
        if m is None:
            raise HostlistError(
                f"hostlist {expr!r}: bad range {item!r} in '[{body}]'; expected N or N-M with digits"
            )
        lo_text, hi_text = m.group(1), m.group(2)
        lo = int(lo_text)
        hi = lo if hi_text is None else int(hi_text)
        if hi < lo:
            raise HostlistError(f"hostlist {expr!r}: range {item!r} runs backwards ({lo} > {hi})")
        if len(numbers) + hi - lo + 1 > MAX_HOSTS:
            raise HostlistError(f"hostlist {expr!r}: expands to more than {MAX_HOSTS} names")
        width = len(lo_text)
        numbers.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return numbers


def _expand_one(expr: str, host_expr: str) -> list[str]:
    """Expand one host expression without top-level commas, such as `r[1-2]n[01-02]-ib`."""
    names = [""]
    pos = 0
    for m in _BRACKET_RE.finditer(host_expr):
        literal = host_expr[pos : m.start()]
        names = [name + literal for name in names]
        if not m.group(1).strip():
            raise HostlistError(f"hostlist {expr!r}: empty brackets '[]'")
        numbers = _expand_ranges(expr, m.group(1))
        if len(names) * len(numbers) > MAX_HOSTS:
            raise HostlistError(f"hostlist {expr!r}: expands to more than {MAX_HOSTS} names")
        names = [name + number for name in names for number in numbers]
        pos = m.end()
    tail = host_expr[pos:]
    return [name + tail for name in names]


def expand_hostlist(expr: str) -> list[str]:
    """Expand a Slurm hostlist expression into host names, in order, duplicates kept.

    Args:
        expr: e.g. `"n[01-04,07],gpu-a[1-2]"`; surrounding whitespace is ignored; `""` → `[]`.
    Returns:
        e.g. `["n01", "n02", "n03", "n04", "n07", "gpu-a1", "gpu-a2"]`.
    Raises:
        HostlistError: unbalanced or nested brackets, empty names, bad or backward ranges,
            more than MAX_HOSTS names; the message quotes `expr`.
    """
    text = expr.strip()
    if not text:
        return []
    hosts: list[str] = []
    for part in _split_top_level(text):
        if not part.strip():
            raise HostlistError(f"hostlist {expr!r}: empty host name between commas")
        hosts.extend(_expand_one(expr, part.strip()))
        if len(hosts) > MAX_HOSTS:
            raise HostlistError(f"hostlist {expr!r}: expands to more than {MAX_HOSTS} names")
    return hosts


def compress_hostlist(hosts: Sequence[str]) -> str:
    """Compress host names into a hostlist expression; `expand_hostlist` gives `hosts` back exactly.

    Order is kept: only neighbours that share the text around their last number are merged
    (`n1,n2,n3,n5` → `n[1-3,5]`; `n1,m1,n2` stays as is). Zero padding is kept per range.

    Raises:
        HostlistError: a name is empty, has whitespace, or contains `[`, `]` or `,`.
    """
    groups: list[tuple[str, str, list[list[str]]]] = []  # (prefix, suffix, [[lo, hi-or-lo], ...])
    for host in hosts:
        if not host or any(c in host for c in "[],") or host != host.strip() or " " in host:
            raise HostlistError(
                f"host name {host!r} cannot be part of a hostlist (empty, space, '[', ']' or ',')"
            )
        m = _LAST_NUMBER_RE.match(host)
        if m is None:
            groups.append((host, "", []))
            continue
        prefix, digits, suffix = m.groups()
        if groups and groups[-1][2] and groups[-1][0] == prefix and groups[-1][1] == suffix:
            ranges = groups[-1][2]
            lo, hi = ranges[-1]
            if int(digits) == int(hi) + 1 and str(int(digits)).zfill(len(lo)) == digits:
                ranges[-1][1] = digits
            else:
                ranges.append([digits, digits])
        else:
            groups.append((prefix, suffix, [[digits, digits]]))
    parts: list[str] = []
    for prefix, suffix, ranges in groups:
        if not ranges:
            parts.append(prefix)
        elif len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
            parts.append(f"{prefix}{ranges[0][0]}{suffix}")
        else:
            body = ",".join(lo if lo == hi else f"{lo}-{hi}" for lo, hi in ranges)
            parts.append(f"{prefix}[{body}]{suffix}")
    return ",".join(parts)


def expand_counts(expr: str) -> list[int]:
    """Expand a Slurm per-node count list such as `SLURM_TASKS_PER_NODE`.

    Args:
        expr: e.g. `"2(x3),1"`.
    Returns:
        one count per node, e.g. `[2, 2, 2, 1]`.
    Raises:
        HostlistError: an item is not `N` or `N(xR)` with R ≥ 1, or the list is empty.
    """
    counts: list[int] = []
    for item in expr.strip().split(","):
        m = _COUNT_RE.match(item.strip())
        if m is None or (m.group(2) is not None and int(m.group(2)) == 0):
            raise HostlistError(f"count list {expr!r}: bad item {item!r}; expected N or N(xR) with R >= 1")
        repeat = 1 if m.group(2) is None else int(m.group(2))
        if len(counts) + repeat > MAX_HOSTS:
            raise HostlistError(f"count list {expr!r}: more than {MAX_HOSTS} entries")
        counts.extend([int(m.group(1))] * repeat)
    return counts


def compress_counts(counts: Sequence[int]) -> str:
    """Inverse of `expand_counts`: `[2, 2, 2, 1]` → `"2(x3),1"`.

    Raises:
        HostlistError: `counts` is empty or holds a negative number.
    """
    if not counts:
        raise HostlistError("count list is empty; expected at least one count")
    parts: list[str] = []
    i = 0
    while i < len(counts):
        value = counts[i]
        if value < 0:
            raise HostlistError(f"count list {list(counts)!r}: negative count {value}")
        j = i
        while j < len(counts) and counts[j] == value:
            j += 1
        parts.append(str(value) if j - i == 1 else f"{value}(x{j - i})")
        i = j
    return ",".join(parts)
