"""Stream one log file and keep what a failure report needs: tracebacks and error lines, in bounded memory.

The file is read in `CHUNK_BYTES` blocks, never whole. Each block is searched for a few literal triggers with
`bytes.find` (C speed); only the lines around a hit are decoded. A Python traceback (also torch's
`[rank0]: `-prefixed form) is followed line by line until its exception line and any continuation, across
block boundaries; only its first `TB_HEAD_LINES` and last `TB_TAIL_LINES` lines are kept. The first and the
last traceback of a file are kept (the last one of a crashed process is the fatal one), plus the first and
last `HIT_LINES` trigger lines outside tracebacks.

`ScanResult.error_lines` counts the lines containing `Error` or `Traceback`, the same number that
`grep -c -E 'Error|Traceback'` prints (benchmarks/logs.py checks it).
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

#: Bytes read per block.
CHUNK_BYTES = 1 << 20
#: Literal triggers: a line holding one of them is looked at. `rror` covers Error and error (OSError,
#: `srun: error:`, `slurmstepd: error: *** ... DUE TO TIME LIMIT`, torch's `c10::DistBackendError` after an
#: NCCL watchdog timeout). Each extra trigger costs one more pass over every block.
TRIGGERS = (b"rror", b"Traceback")
#: The traceback header (after an optional `[rankN]: ` prefix).
TB_HEADER = b"Traceback (most recent call last):"
_CHAIN_PREFIXES = (b"During handling of the above exception", b"The above exception was the direct cause")
#: Bounded windows (lines).
TB_HEAD_LINES = 40
TB_TAIL_LINES = 60
HIT_LINES = 8
#: Longest line kept, in characters (a megabyte-long line is cut).
MAX_LINE_CHARS = 2000
#: Blank lines allowed between an exception line and a chained traceback.
_MAX_BLANKS = 2


@dataclass(frozen=True, slots=True)
class Traceback:
    """One traceback block: `lineno` (1-based line of its header), `lines` (prefix stripped; a `...` marker
    where the bounded window dropped lines), `n_lines` (its real length)."""

    lineno: int
    lines: tuple[str, ...]
    n_lines: int

    @property
    def exception_line(self) -> str:
        """The last non-indented line that is not a header or connector: `pkg.Error: message`."""
        for line in reversed(self.lines):
            if (
                line
                and not line[0].isspace()
                and not line.startswith(("Traceback", "During", "The above", "..."))
            ):
                return line
        return ""


@dataclass(frozen=True, slots=True)
class ScanResult:
    """What `scan_log` kept of one file. `hits`: (lineno, line) of trigger lines outside tracebacks."""

    path: str
    size_bytes: int
    n_lines: int
    error_lines: int
    n_tracebacks: int
    first_traceback: Traceback | None
    last_traceback: Traceback | None
    first_hits: tuple[tuple[int, str], ...]
    last_hits: tuple[tuple[int, str], ...]

    def evidence_lines(self) -> list[str]:
        """The lines a classifier should read, fatal traceback first."""
        out: list[str] = []
        if self.last_traceback is not None:
            out += [self.last_traceback.exception_line, *self.last_traceback.lines]
        out += [line for _, line in self.last_hits] + [line for _, line in self.first_hits]
        return out


def _decode(raw: bytes) -> str:
    text = raw.decode("utf-8", errors="replace").rstrip("\r")
    return text if len(text) <= MAX_LINE_CHARS else text[:MAX_LINE_CHARS] + "…"


@dataclass(slots=True)
class _TbBuilder:
    lineno: int
    prefix: bytes
    head: list[str] = field(default_factory=list)
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TB_TAIL_LINES))
    n_lines: int = 0
    after_exception: bool = False
    blanks: int = 0

    def add(self, text: str) -> None:
        self.n_lines += 1
        if len(self.head) < TB_HEAD_LINES:
            self.head.append(text)
        else:
            self.tail.append(text)

    def build(self) -> Traceback:
        dropped = self.n_lines - len(self.head) - len(self.tail)
        middle = (f"... ({dropped} lines)",) if dropped > 0 else ()
        return Traceback(self.lineno, (*self.head, *middle, *self.tail), self.n_lines)

    def feed(self, line: bytes) -> bool:
        """Take one raw line (no newline); False when the line is not part of the traceback."""
        if self.prefix:
            if line.startswith(self.prefix):
                line = line[len(self.prefix) :]
            elif line.rstrip() == self.prefix.rstrip():
                line = b""  # torch prints a bare "[rank0]:" for an empty line
        stripped = line.strip()
        if not self.after_exception:
            if not stripped or line[:1].isspace() or line.startswith(b"Traceback ("):
                self.add(_decode(line))
                return True
            self.add(_decode(line))  # the exception line
            self.after_exception = True
            return True
        if not stripped:
            self.blanks += 1
            return self.blanks <= _MAX_BLANKS
        if line.startswith(_CHAIN_PREFIXES):
            self.blanks = 0
            self.add(_decode(line))
            self.after_exception = False
            return True
        if line[:1].isspace() and self.blanks == 0:
            self.add(_decode(line))  # a multi-line exception message
            return True
        return False


class LogScanner:
    """Incremental scanner; `feed(block)` any number of times, then `finish()`."""

    def __init__(self, path: str = "") -> None:
        self.path = path
        self._carry = b""
        self._line_base = 0  # lines before the carry
        self._size = 0
        self._error_lines = 0
        self._n_tb = 0
        self._first_tb: Traceback | None = None
        self._last_tb: Traceback | None = None
        self._tb: _TbBuilder | None = None
        self._first_hits: list[tuple[int, str]] = []
        self._last_hits: deque[tuple[int, str]] = deque(maxlen=HIT_LINES)

    def feed(self, block: bytes) -> None:
        self._size += len(block)
        buf = self._carry + block if self._carry else block
        cut = buf.rfind(b"\n") + 1
        if cut == 0:
            self._carry = buf
            return
        self._carry = buf[cut:]
        self._process(buf, cut)

    def finish(self) -> ScanResult:
        if self._carry:
            buf = self._carry + b"\n"
            self._carry = b""
            self._process(buf, len(buf))
        self._close_tb()
        return ScanResult(
            path=self.path,
            size_bytes=self._size,
            n_lines=self._line_base,
            error_lines=self._error_lines,
            n_tracebacks=self._n_tb,
            first_traceback=self._first_tb,
            last_traceback=self._last_tb,
            first_hits=tuple(self._first_hits),
            last_hits=tuple(self._last_hits),
        )

    def _close_tb(self) -> None:
        if self._tb is not None:
            tb = self._tb.build()
            self._n_tb += 1
            if self._first_tb is None:
                self._first_tb = tb
            self._last_tb = tb
            self._tb = None

    def _count_error(self, line: bytes) -> None:
        if b"Error" in line or b"Traceback" in line:
            self._error_lines += 1

    def _process(self, buf: bytes, end: int) -> None:
        """Handle the complete lines `buf[:end]` (end is just after a newline)."""
        pos, line_no = 0, self._line_base  # line_no: lines before `pos`
        if self._tb is not None:
            pos, line_no = self._follow_tb(buf, 0, end, line_no)
        starts = set()
        for trigger in TRIGGERS:
            p = buf.find(trigger, pos, end)
            while p != -1:
                s = buf.rfind(b"\n", 0, p) + 1
                starts.add(s)
                nl = buf.find(b"\n", p, end)
                p = buf.find(trigger, nl + 1, end)
        for s in sorted(starts):
            if s < pos:
                continue  # inside a traceback already followed
            line_no += buf.count(b"\n", pos, s)
            nl = buf.find(b"\n", s, end)
            line = buf[s:nl]
            marker = line.find(TB_HEADER)
            if marker != -1 and (marker == 0 or line[:marker].strip().endswith(b":")):
                self._tb = _TbBuilder(lineno=line_no + 1, prefix=line[:marker])
                self._tb.add(_decode(line[marker:]))
                self._count_error(line)
                pos, line_no = self._follow_tb(buf, nl + 1, end, line_no + 1)
                continue
            self._count_error(line)
            hit = (line_no + 1, _decode(line))
            if len(self._first_hits) < HIT_LINES:
                self._first_hits.append(hit)
            else:
                self._last_hits.append(hit)
            pos, line_no = nl + 1, line_no + 1
        self._line_base = line_no + buf.count(b"\n", pos, end)

    def _follow_tb(self, buf: bytes, pos: int, end: int, line_no: int) -> tuple[int, int]:
        """Feed lines from `pos` to the open traceback until it ends or the block does."""
        assert self._tb is not None
        while pos < end:
            nl = buf.find(b"\n", pos, end)
            line = buf[pos:nl]
            if not self._tb.feed(line):
                self._close_tb()
                return pos, line_no  # this line is looked at again as an ordinary line
            self._count_error(line)
            pos, line_no = nl + 1, line_no + 1
        return pos, line_no


def scan_log(path: str | os.PathLike[str], chunk_bytes: int = CHUNK_BYTES) -> ScanResult:
    """Stream `path` through a `LogScanner` (bounded memory whatever the file size).

    Raises:
        OSError: the file cannot be opened or read.
    """
    scanner = LogScanner(str(path))
    with open(Path(path), "rb", buffering=0) as fh:
        while block := fh.read(chunk_bytes):
            scanner.feed(block)
    return scanner.finish()
