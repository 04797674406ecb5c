"""Atomic file writes: temp file in the same directory, fsync, os.replace (STYLE.md rule 12).

A crash leaves either the old file or the new one, never a half-written file. `publish_dir` does the same for a
directory written completely under a temporary name (checkpoints, exports).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: str = "w", perms: int | None = None) -> Iterator[IO[Any]]:
    """Open a temp file beside `path`; on clean exit fsync it and rename it onto `path`.

    Args:
        path: destination file.
        mode: "w" (text) or "wb" (binary).
        perms: file mode bits of the result (e.g. 0o600 for secrets); default 0o644 less the umask.
    Raises:
        OSError: the directory is not writable; the destination is left unchanged.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open mode must be 'w' or 'wb', got {mode!r}")
    dest = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    try:
        os.fchmod(fd, perms if perms is not None else 0o644 & ~_umask())
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
        _fsync_dir(dest.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str, perms: int | None = None) -> None:
    """Write `text` to `path` atomically."""
    with atomic_open(path, "w", perms) as f:
        f.write(text)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, perms: int | None = None) -> None:
    """Write `data` to `path` atomically."""
    with atomic_open(path, "wb", perms) as f:
        f.write(data)


def atomic_write_json(path: str | os.PathLike[str], obj: Any, perms: int | None = None) -> None:
    """Write `obj` as indented JSON to `path` atomically."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n", perms)


def publish_dir(tmp: str | os.PathLike[str], final: str | os.PathLike[str]) -> Path:
    """Rename the complete directory `tmp` to `final` (atomic on POSIX: a reader sees the old copy or the new
    one, never a partial one). An existing `final` (a step written again after a resume) is first renamed to a
    hidden sibling `.<name>.tmp-old-<pid>` and removed. Returns `final` as a Path. Raises OSError."""
    src, dst = Path(tmp), Path(final)
    if dst.exists():
        retired = dst.parent / f".{dst.name}.tmp-old-{os.getpid()}"
        dst.rename(retired)
        shutil.rmtree(retired, ignore_errors=True)
    src.rename(dst)
    _fsync_dir(dst.parent)
    return dst


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
