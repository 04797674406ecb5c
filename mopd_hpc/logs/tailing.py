"""Child logs merged with `[host role-index]` prefixes: the last lines of each, then (`follow`) new lines as
they are written, polled. Files: `run_dir/logs/<host>/<role>-<index>.g<generation>.{out,err}`
(`mopd_hpc.runtime.guard.children`). Nothing is read whole: the last lines come from reading backwards in
blocks, and following reads only the bytes appended since the previous poll.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

#: `<role>-<index>.g<generation>.<stream>`
CHILD_LOG_RE = re.compile(
    r"^(?P<role>[a-z][a-z0-9_-]*)-(?P<index>[0-9]+)\.g(?P<gen>[0-9]+)\.(?P<stream>out|err)$"
)
#: Block size when reading a file backwards for its last lines.
_BACK_BLOCK = 64 * 1024
#: Seconds between polls while following.
FOLLOW_POLL_S = 0.5


@dataclass(frozen=True, slots=True)
class ChildLog:
    """One child log file, identified from its path."""

    host: str
    role: str
    index: int
    generation: int
    stream: str
    path: Path

    @property
    def prefix(self) -> str:
        """`[n1 actor-0]`; a restarted generation reads `[n1 actor-0.g2]`."""
        gen = f".g{self.generation}" if self.generation > 1 else ""
        return f"[{self.host} {self.role}-{self.index}{gen}]"


def find_child_logs(
    run_dir: str | os.PathLike[str], role: str | None = None, rank: int | None = None
) -> list[ChildLog]:
    """The child logs of `run_dir`, filtered by `role` and `rank` (the child's index), in name order."""
    logs = Path(run_dir) / "logs"
    found = []
    if not logs.is_dir():
        return found
    for host_dir in sorted(p for p in logs.iterdir() if p.is_dir()):
        for path in sorted(host_dir.iterdir()):
            m = CHILD_LOG_RE.match(path.name)
            if (
                m is None
                or (role is not None and m["role"] != role)
                or (rank is not None and int(m["index"]) != rank)
            ):
                continue
            found.append(
                ChildLog(host_dir.name, m["role"], int(m["index"]), int(m["gen"]), m["stream"], path)
            )
    return found


def read_last_lines(path: str | os.PathLike[str], n: int) -> list[str]:
    """The last `n` lines of `path` (decoded with replacement), reading backwards in blocks; [] if unreadable."""
    if n <= 0:
        return []
    try:
        with open(path, "rb") as fh:
            end = fh.seek(0, os.SEEK_END)
            data, pos = b"", end
            while pos > 0 and data.count(b"\n") <= n:
                step = min(_BACK_BLOCK, pos)
                pos -= step
                fh.seek(pos)
                data = fh.read(step) + data
    except OSError:
        return []
    lines = data.decode("utf-8", errors="replace").splitlines()
    return lines[-n:]


def print_tail(logs: list[ChildLog], out: TextIO, lines: int) -> dict[Path, int]:
    """Print the last `lines` lines of each log, prefixed, oldest-modified file first (the freshest output
    ends up at the bottom). Returns each file's size: the offsets `follow` continues from."""

    def mtime(log: ChildLog) -> float:
        try:
            return log.path.stat().st_mtime
        except OSError:
            return 0.0

    offsets = {}
    for log in sorted(logs, key=lambda x: (mtime(x), x.host, x.role, x.index, x.generation, x.stream)):
        try:
            offsets[log.path] = log.path.stat().st_size
        except OSError:
            continue
        for line in read_last_lines(log.path, lines):
            out.write(f"{log.prefix} {line}\n")
    out.flush()
    return offsets


def poll_once(logs: list[ChildLog], offsets: dict[Path, int], partial: dict[Path, bytes], out: TextIO) -> int:
    """Print every complete line appended since `offsets` (updated in place; a file that shrank is read from
    its start); returns the number of lines printed. Incomplete last lines wait in `partial`."""
    printed = 0
    for log in logs:
        try:
            size = log.path.stat().st_size
        except OSError:
            continue
        start = offsets.get(log.path, 0)
        if size < start:
            start, partial[log.path] = 0, b""
        if size == start:
            continue
        with open(log.path, "rb") as fh:
            fh.seek(start)
            data = partial.get(log.path, b"") + fh.read(size - start)
        offsets[log.path] = size
        cut = data.rfind(b"\n") + 1
        partial[log.path] = data[cut:]
        for raw in data[:cut].splitlines():
            out.write(f"{log.prefix} {raw.decode('utf-8', errors='replace')}\n")
            printed += 1
    if printed:
        out.flush()
    return printed


def follow(
    run_dir: str | os.PathLike[str],
    out: TextIO,
    offsets: dict[Path, int],
    role: str | None = None,
    rank: int | None = None,
    poll_s: float = FOLLOW_POLL_S,
    should_stop: Callable[[], bool] = lambda: False,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Poll for new lines (and new child logs, e.g. a restarted generation) until `should_stop()` is true or
    KeyboardInterrupt. A log that appears after the start is printed from its beginning."""
    partial: dict[Path, bytes] = {}
    try:
        while not should_stop():
            poll_once(find_child_logs(run_dir, role, rank), offsets, partial, out)
            sleep(poll_s)
    except KeyboardInterrupt:
        pass
