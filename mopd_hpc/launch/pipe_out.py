"""An output stream that survives its reader going away (`mopd-submit … | head -1`, `| tee` after Ctrl-C).

Python ignores SIGPIPE, so a write to a closed pipe raises BrokenPipeError wherever it happens: in a status
line of a running job that would end `mopd-submit` with a traceback, and its `finally` would SIGKILL the
guard mid-teardown (rich's console instead exits 1 silently, before anything ran). `PipeOut` turns the
first EPIPE into a flag, `broken`, and points the stream's file descriptor at /dev/null (the recipe of
Python's signal docs, "Note on SIGPIPE"), so later writes and the interpreter's last flush succeed quietly.
The local backend reads `broken` and stops the job as a lost terminal would (launch/local.py).
"""

from __future__ import annotations

import contextlib
import os
import select
import stat
from typing import Any, TextIO


class PipeOut:
    """Wraps a text stream (sys.stdout); `write`/`flush` never raise BrokenPipeError.

    Attributes:
        broken: True once a write or flush met a closed reader; output is discarded from then on.
    """

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.broken = False

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._break()
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._break()

    def check(self) -> bool:
        """`broken`, found also without writing: the write end of a pipe whose every reader has closed polls
        POLLERR on Linux (fs/pipe.c `pipe_poll`), so a quiet job notices `| head` has exited."""
        if not self.broken:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                fd = self._stream.fileno()
                if stat.S_ISFIFO(os.fstat(fd).st_mode):
                    poller = select.poll()
                    poller.register(fd, 0)  # POLLERR and POLLHUP are reported whatever is asked
                    if any(ev & select.POLLERR for _, ev in poller.poll(0)):
                        self._break()
        return self.broken

    def isatty(self) -> bool:
        return not self.broken and self._stream.isatty()

    def __getattr__(self, name: str) -> Any:  # encoding, fileno, ... of the wrapped stream
        return getattr(self._stream, name)

    def _break(self) -> None:
        self.broken = True
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)


def is_broken(stream: object) -> bool:
    """True when `stream` is a PipeOut whose reader went away (checked now: `PipeOut.check`)."""
    return stream.check() if isinstance(stream, PipeOut) else False
