"""The job index: one JSON line per submission, so that `mopd-logs summarize JOB_ID` finds the run directory.

`mopd-submit` appends `{"job_id": "123", "run_dir": "/abs", "name": ..., "submitted_at": ts, "config": path}`
to `<state_home>/mopd_hpc/jobs.jsonl`, where `state_home` is `$XDG_STATE_HOME`, else `~/.local/state`
(XDG Base Directory spec). The environment is read at the CLI edge only (`state_home_from_env(env)`).
Appends are one `write` on an O_APPEND file, so concurrent submitters never interleave a line.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mopd_hpc.runtime.jobids import JobIdError, fold_job_id

#: A local-backend job id (`launch/local.py`: `local-<pid>`); kept as is, never folded.
LOCAL_JOB_ID = re.compile(r"^local-[0-9]+$")

#: Index location under the state home.
INDEX_RELPATH = Path("mopd_hpc") / "jobs.jsonl"
#: Environment variable naming the state home (XDG Base Directory spec), and its default under $HOME.
STATE_HOME_ENV = "XDG_STATE_HOME"
DEFAULT_STATE_HOME = Path(".local") / "state"


class JobIndexError(ValueError):
    """A job-index entry is malformed, or a job id is not in the index."""


@dataclass(frozen=True, slots=True)
class JobIndexEntry:
    """One submission. `job_id` is the leader id as sbatch printed it; `run_dir` is absolute."""

    job_id: str
    run_dir: str
    name: str | None = None
    submitted_at: float | None = None
    config: str | None = None

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> JobIndexEntry:
        """Validate a decoded entry.

        Raises:
            JobIndexError: `job_id` is not a Slurm job id, or `run_dir` is not an absolute path.
        """
        job_id = str(obj.get("job_id", ""))
        try:
            index_key(job_id)
        except JobIdError:
            raise JobIndexError(
                f"job index entry job_id={job_id!r}: expected a Slurm job id like 123 or a local one like local-42"
            ) from None
        run_dir = obj.get("run_dir")
        if not isinstance(run_dir, str) or not os.path.isabs(run_dir):
            raise JobIndexError(
                f"job index entry run_dir={run_dir!r} (job {job_id}): expected an absolute path"
            )
        ts = obj.get("submitted_at")
        return cls(
            job_id=job_id,
            run_dir=run_dir,
            name=None if obj.get("name") is None else str(obj["name"]),
            submitted_at=float(ts) if isinstance(ts, int | float) else None,
            config=None if obj.get("config") is None else str(obj["config"]),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "run_dir": self.run_dir,
            "name": self.name,
            "submitted_at": self.submitted_at,
            "config": self.config,
        }


def index_key(job_id: str) -> str:
    """The key a job is found by: a Slurm id folded to its leader (`123+1.0` → `123`), a local id as is.

    Raises:
        JobIdError: neither form.
    """
    return job_id if LOCAL_JOB_ID.match(job_id) else fold_job_id(job_id)


def state_home_from_env(env: Mapping[str, str]) -> Path:
    """`$XDG_STATE_HOME` if set and absolute (the spec ignores relative values), else `$HOME/.local/state`."""
    value = env.get(STATE_HOME_ENV, "")
    if value and os.path.isabs(value):
        return Path(value)
    home = env.get("HOME") or str(Path.home())
    return Path(home) / DEFAULT_STATE_HOME


def index_path(state_home: str | os.PathLike[str]) -> Path:
    return Path(state_home) / INDEX_RELPATH


def append_job_index(entry: JobIndexEntry | Mapping[str, Any], state_home: str | os.PathLike[str]) -> Path:
    """Append `entry` to the index under `state_home` (created 0700 if missing); returns the index path.

    Raises:
        JobIndexError: the entry is malformed (nothing is written).
    """
    record = entry if isinstance(entry, JobIndexEntry) else JobIndexEntry.from_dict(entry)
    path = index_path(state_home)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    line = (json.dumps(record.to_dict(), sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    return path


def find_run_dir(job_id: str, state_home: str | os.PathLike[str]) -> Path:
    """The run directory of `job_id` (any form: `123`, `123+1`, `123+1.0`, `local-42`); the latest submission
    wins.

    The index is streamed line by line; malformed lines are skipped.

    Raises:
        JobIndexError: `job_id` is not a job id, the index is missing, or the job is not in it (the message
            names the index path).
    """
    try:
        leader = index_key(job_id)
    except JobIdError:
        raise JobIndexError(
            f"job id {job_id!r}: expected a Slurm job id like 123 or 123+1, or local-N"
        ) from None
    path = index_path(state_home)
    found: str | None = None
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                try:
                    entry = JobIndexEntry.from_dict(json.loads(line))
                except (ValueError, AttributeError):
                    continue
                if index_key(entry.job_id) == leader:
                    found = entry.run_dir
    except FileNotFoundError:
        raise JobIndexError(
            f"job {leader}: the job index {path} does not exist (mopd-submit writes it); pass the run dir instead"
        ) from None
    if found is None:
        raise JobIndexError(f"job {leader} is not in the job index {path}; pass the run dir instead")
    return Path(found)
