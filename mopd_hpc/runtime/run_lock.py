"""One job per run directory: a kernel-held lock on `run_dir/run.lock`, held for the job's life.

Two jobs on one run dir mix their logs and metrics, talk to each other's servers and overwrite each other's
checkpoints. The lock is `flock(LOCK_EX)` on `run_dir/run.lock` (man 2 flock): the kernel frees it when the
last process holding the open file description exits, SIGKILL included, so a crashed job never leaves a
stale lock behind. The file holds the holder's record (`job_id`, `host`, `pid`, `since`), read to name it
in the refusal; a record left by a dead holder is simply overwritten by the next one. Every refusal is also
appended to `run_dir/events/refused.jsonl` (`REFUSED_FILE`: the refused job's id, host, pid, time and the
holder's record; one O_APPEND write, nothing of the holder touched), so that `mopd-logs summarize` of the
holder's job shows who was turned away.

Who holds it: `mopd-submit --local` (before it writes anything into the run dir; the guard it starts
inherits the descriptor, so the lock lives while either does), and every guard at start (`mopd-guard`:
the first guard of a job takes it, the other guards of the same job id join without taking it; its keeper
inherits the descriptor). On NFS, Linux emulates flock with POSIX byte-range locks, which other clients
see; a file system without locks (Lustre mounted without `-o flock`) makes `acquire` return a lock that
holds nothing, with `unsupported` set so the caller can say so.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The lock file, in the run directory.
LOCK_FILE_NAME = "run.lock"
#: The refusals, one JSON line each, relative to the run directory.
REFUSED_FILE = "events/refused.jsonl"
#: How long to wait for a holder that has the lock but has not written its record yet, seconds.
_RECORD_WAIT_S = 0.5


class RunDirLockedError(RuntimeError):
    """Another job holds the run directory; the message names it (job id, host, pid) and the way out."""

    def __init__(self, run_dir: Path, holder: dict[str, Any]) -> None:
        self.run_dir, self.holder = run_dir, holder
        since = holder.get("since")
        when = (
            time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since))
            if isinstance(since, float)
            else ""
        )
        who = (
            f"job {holder.get('job_id')} (host {holder.get('host')}, pid {holder.get('pid')}{when})"
            if holder
            else "a job that has not written its record yet"
        )
        super().__init__(
            f"run dir {run_dir} is in use by {who}: two jobs on one run dir would mix their logs, metrics "
            "and checkpoints; wait for it to end, stop it (scancel, or Ctrl-C on its mopd-submit), or use "
            "another --run-dir"
        )


@dataclass(slots=True)
class RunLock:
    """A held (or joined) run-dir lock. `fd` is -1 when this process joined a lock its job already holds
    or when the file system has no locks (`unsupported`)."""

    path: Path
    fd: int
    holder: dict[str, Any]
    unsupported: bool = False

    @property
    def held(self) -> bool:
        return self.fd >= 0

    def inheritable(self) -> RunLock:
        """Let a child exec'ed by this process share the lock (Popen `pass_fds`, or an exec in place)."""
        if self.held:
            os.set_inheritable(self.fd, True)
        return self

    def release(self) -> None:
        """Close this process's descriptor (the lock ends when no process holds one any more). Idempotent."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def read_holder(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The record in `run_dir/run.lock` ({} when absent or unreadable). It names the holder only while
    the lock is held (`holder_of`)."""
    try:
        data = json.loads((Path(run_dir) / LOCK_FILE_NAME).read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def acquire(run_dir: str | os.PathLike[str], job_id: str, host: str, pid: int | None = None) -> RunLock:
    """Take the run-dir lock for `job_id`, or join it when `job_id` already holds it.

    Args:
        run_dir: the run directory (created, mode 0700, when absent).
        job_id, host, pid: the record written while the lock is held (pid: default this process).
    Returns:
        the held lock (fd ≥ 0) or, when the same job holds it, a joined one (fd -1).
    Raises:
        RunDirLockedError: another job holds it (the message names job id, host and pid).
    """
    root = Path(run_dir)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = root / LOCK_FILE_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            return RunLock(path, -1, {}, unsupported=True)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
        holder = _holder_record(root)
        if holder.get("job_id") == job_id:
            return RunLock(path, -1, holder)
        record_refusal(root, job_id, host, holder, pid)
        raise RunDirLockedError(root, holder) from None
    record = {
        "job_id": job_id,
        "host": host,
        "pid": os.getpid() if pid is None else pid,
        "since": time.time(),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record, sort_keys=True) + "\n").encode(), 0)  # ephemeral: no fsync
    return RunLock(path, fd, record)


def holder_of(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The record of the job holding `run_dir`'s lock, or None when no job holds it (probe: takes nothing)."""
    path = Path(run_dir) / LOCK_FILE_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return _holder_record(Path(run_dir))
        return None  # no locks on this file system: nothing to say
    finally:
        os.close(fd)
    return None


def claim(run_dir: str | os.PathLike[str], job_id: str | None, host: str) -> RunLock | None:
    """Before anything is written into `run_dir`: with a `job_id` (a job that runs here), `acquire`;
    without (a Slurm submission or a render: its guards take the lock when the job starts), only check
    that no running job holds it. Raises RunDirLockedError naming the holder."""
    if job_id is not None:
        return acquire(run_dir, job_id, host)
    holder = holder_of(run_dir)
    if holder is not None:
        record_refusal(run_dir, None, host, holder)
        raise RunDirLockedError(Path(run_dir), holder)
    return None


def record_refusal(
    run_dir: str | os.PathLike[str],
    job_id: str | None,
    host: str,
    holder: dict[str, Any],
    pid: int | None = None,
) -> None:
    """Append one refusal to `run_dir/REFUSED_FILE`: {ts, job_id (None: a submission, its id not known
    yet), host, pid (default this process), holder}. Best effort: the refusal itself is the error the
    caller raises; a run dir this process cannot write to only loses the record."""
    record = {
        "ts": time.time(),
        "job_id": job_id,
        "host": host,
        "pid": os.getpid() if pid is None else pid,
        "holder": holder,
    }
    path = Path(run_dir) / REFUSED_FILE
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, (json.dumps(record, sort_keys=True) + "\n").encode())
        finally:
            os.close(fd)


def read_refusals(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every refusal recorded in `run_dir` (`record_refusal`), oldest first; torn or foreign lines skipped."""
    out = []
    try:
        with open(Path(run_dir) / REFUSED_FILE, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and isinstance(record.get("holder"), dict):
                    out.append(record)
    except OSError:
        return []
    return out


def _holder_record(root: Path) -> dict[str, Any]:
    deadline = time.monotonic() + _RECORD_WAIT_S
    while not (holder := read_holder(root)) and time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            time.sleep(0.02)
    return holder
