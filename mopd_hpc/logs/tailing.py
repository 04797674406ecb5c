"""Child logs merged with `[host role-index]` prefixes: the last lines of each, then (`follow`) new lines as
they are written, polled. Lines are merged by time: a line that starts with a timestamp (Python logging's
`2026-11-30 00:55:09,592`, ISO `2026-11-30T00:55:09.592`, or c10/glog's `[W1130 00:46:19.091`, read as local
time) is placed at that time; a line without one keeps the time of the line before it in the same file
(lines before a file's first timestamp take that first timestamp; a file without any takes its modification
time, or the poll's time while following). Equal times keep file order, then line order (a stable sort). Files: `run_dir/logs/<host>/<role>-<index>.g<generation>.{out,err}`
(`mopd_hpc.runtime.guard.children`). Nothing is read whole: the last lines come from reading backwards in
blocks, and following reads only the bytes appended since the previous poll.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from mopd_hpc.records.run_dir import LOGS_DIR

#: `<role>-<index>.g<generation>.<stream>`
CHILD_LOG_RE = re.compile(
    r"^(?P<role>[a-z][a-z0-9_-]*)-(?P<index>[0-9]+)\.g(?P<gen>[0-9]+)\.(?P<stream>out|err)$"
)
#: A timestamp at the start of a line: Python logging / ISO 8601 (date and time).
_ISO_TS = re.compile(r"^\[?(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:[.,](\d{1,9}))?")
#: c10/glog: `[W1130 00:46:19.091050865 file.cpp:207]` (month, day; no year: the file's year is used).
_GLOG_TS = re.compile(r"^\[?[IWEF](\d{2})(\d{2}) (\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?")
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
    logs = Path(run_dir) / LOGS_DIR
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


def known_roles(run_dir: str | os.PathLike[str]) -> tuple[str, ...]:
    """The roles `--role` accepts: the plan's roles (`runtime.topology.ROLES`) and any role with a child log
    in `run_dir`, sorted."""
    from mopd_hpc.runtime.topology import ROLES

    return tuple(sorted(set(ROLES) | {log.role for log in find_child_logs(run_dir)}))


def line_time(line: str, year: int) -> float | None:
    """Unix time of the timestamp that starts `line` (local time; module docstring), or None.

    year: used for glog-style timestamps, which carry none.
    """
    m = _ISO_TS.match(line)
    if m is not None:
        y, mo, d, h, mi, sec, frac = m.groups()
    else:
        g = _GLOG_TS.match(line)
        if g is None:
            return None
        mo, d, h, mi, sec, frac = g.groups()
        y = str(year)
    try:
        when = dt.datetime(int(y), int(mo), int(d), int(h), int(mi), int(sec))
    except ValueError:
        return None
    return when.timestamp() + (float(f"0.{frac}") if frac else 0.0)


def timed_lines(
    lines: list[str], year: int, before: float | None, fallback: float
) -> list[tuple[float, str]]:
    """`lines` of one file, each with its time (module docstring). `before`: the time of the file's line
    preceding `lines` (while following), None at the start; `fallback`: the time when no line has one."""
    times = [line_time(line, year) for line in lines]
    first = next((t for t in times if t is not None), None)
    current = before if before is not None else (first if first is not None else fallback)
    out = []
    for t, line in zip(times, lines, strict=True):
        current = t if t is not None else current
        out.append((current, line))
    return out


def _write_merged(chunks: list[tuple[ChildLog, list[tuple[float, str]]]], out: TextIO) -> int:
    """Write every (time, line) of `chunks` sorted by time, stable (chunk order, then line order)."""
    merged = [(t, log.prefix, line) for log, lines in chunks for t, line in lines]
    merged.sort(key=lambda item: item[0])
    for _, prefix, line in merged:
        out.write(f"{prefix} {line}\n")
    return len(merged)


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
    """Print the last `lines` lines of each log, prefixed, merged by time (module docstring; files in
    modification order, oldest first, for equal times). Returns each file's size: the offsets `follow`
    continues from."""
    stats: dict[Path, os.stat_result] = {}
    for log in logs:
        try:
            stats[log.path] = log.path.stat()
        except OSError:
            continue
    present = [log for log in logs if log.path in stats]
    present.sort(key=lambda x: (stats[x.path].st_mtime, x.host, x.role, x.index, x.generation, x.stream))
    chunks = []
    for log in present:
        mtime = stats[log.path].st_mtime
        year = dt.datetime.fromtimestamp(mtime).year
        chunks.append((log, timed_lines(read_last_lines(log.path, lines), year, None, mtime)))
    _write_merged(chunks, out)
    out.flush()
    return {log.path: stats[log.path].st_size for log in present}


def poll_once(
    logs: list[ChildLog],
    offsets: dict[Path, int],
    partial: dict[Path, bytes],
    out: TextIO,
    last_time: dict[Path, float] | None = None,
    now: float | None = None,
) -> int:
    """Print every complete line appended since `offsets` (updated in place; a file that shrank is read from
    its start), merged by time across files; returns the number of lines printed. Incomplete last lines wait
    in `partial`. `last_time` (updated in place) holds each file's last line time; `now` (default: the clock)
    is the time of lines that have none and no earlier line."""
    now = time.time() if now is None else now
    last_time = {} if last_time is None else last_time
    year = dt.datetime.fromtimestamp(now).year
    chunks = []
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
        text = [raw.decode("utf-8", errors="replace") for raw in data[:cut].splitlines()]
        timed = timed_lines(text, year, last_time.get(log.path), now)
        if timed:
            last_time[log.path] = timed[-1][0]
            chunks.append((log, timed))
    printed = _write_merged(chunks, out)
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
    last_time: dict[Path, float] = {}
    try:
        while not should_stop():
            poll_once(find_child_logs(run_dir, role, rank), offsets, partial, out, last_time)
            sleep(poll_s)
    except KeyboardInterrupt:
        pass
