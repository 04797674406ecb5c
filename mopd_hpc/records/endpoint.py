"""A server's endpoint record, `run_dir/endpoints/<role>-<key>.json`: where a teacher replica or a rollout engine
of the job listens, written by the server once it answers and read by the actor (roles/endpoints.py).

One frozen record for both roles, written and read only through `EndpointRecord.write` and `read_endpoint`:

    role         "teacher" | "rollout"
    host, port   where the trainer connects (the guard's advertised address); `url` = http://host:port
    pid          the server's process id
    job_id       the job it belongs to (the trainer accepts only its own job's records); None for a standalone
                 teacher server, whose record no job accepts
    model_path   the checkpoint it serves
    teacher      teacher_id, replica (0 .. replicas − 1), fingerprint (the checkpoint's: engines/teacher/http_app.py)
    rollout      index (the engine's), backend ("hf" | "sglang")

The JSON object holds these keys (a role's own only) and `url`; it is written atomically (mopd_hpc/atomic) and
removed by the server on its way out (a stale record would send the trainer to a closed port).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mopd_hpc.atomic import atomic_write_json
from mopd_hpc.records.run_dir import PathLike, endpoint_file, teacher_endpoint_file

#: The roles that publish an endpoint.
ROLES = ("teacher", "rollout")


class EndpointRecordError(ValueError):
    """An endpoint file that is not a record (not a JSON object, a key missing or of the wrong type)."""


@dataclass(frozen=True, slots=True)
class EndpointRecord:
    """One server's endpoint (module docstring). Build it with `EndpointRecord.teacher` or `.rollout`."""

    role: str
    host: str
    port: int
    pid: int
    job_id: str | None
    model_path: str
    teacher_id: str | None = None
    replica: int | None = None
    fingerprint: str | None = None
    index: int | None = None
    backend: str | None = None

    @classmethod
    def teacher(
        cls,
        teacher_id: str,
        replica: int,
        *,
        host: str,
        port: int,
        pid: int,
        job_id: str | None,
        model_path: str,
        fingerprint: str,
    ) -> EndpointRecord:
        """The record of replica `replica` of teacher `teacher_id`."""
        return cls(
            "teacher",
            host,
            port,
            pid,
            job_id,
            model_path,
            teacher_id=teacher_id,
            replica=replica,
            fingerprint=fingerprint,
        )

    @classmethod
    def rollout(
        cls, index: int, *, host: str, port: int, pid: int, job_id: str | None, model_path: str, backend: str
    ) -> EndpointRecord:
        """The record of rollout engine `index`."""
        return cls("rollout", host, port, pid, job_id, model_path, index=index, backend=backend)

    @property
    def url(self) -> str:
        """`http://host:port`."""
        return f"http://{self.host}:{self.port}"

    def path(self, run_dir: PathLike) -> Path:
        """Where this record lives under `run_dir` (records/run_dir.py `endpoint_file`)."""
        if self.role == "teacher":
            return teacher_endpoint_file(run_dir, str(self.teacher_id), int(self.replica or 0))
        return endpoint_file(run_dir, "rollout", str(self.index))

    def to_json(self) -> dict[str, Any]:
        """The JSON object of the file: the common keys, `url`, and the role's own keys."""
        common = {
            "host": self.host,
            "port": self.port,
            "url": self.url,
            "pid": self.pid,
            "job_id": self.job_id,
        }
        if self.role == "teacher":
            own = {"teacher_id": self.teacher_id, "replica": self.replica, "fingerprint": self.fingerprint}
        else:
            own = {"index": self.index, "backend": self.backend}
        return {"role": self.role, **common, "model_path": self.model_path, **own}

    def write(self, run_dir: PathLike) -> Path:
        """Write the record atomically under `run_dir` (creating `endpoints/`); returns its path.
        Raises OSError when the run directory is not writable."""
        path = self.path(run_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, self.to_json())
        return path

    def job_problem(self, path: Path, job_id: str) -> str | None:
        """Why this record (read from `path`) is not job `job_id`'s, naming both ids; None when it is."""
        if self.job_id is None:
            return (
                f"{path} has no job_id (a standalone server's or an older record), not this job's {job_id!r}"
            )
        if self.job_id != job_id:
            return f"{path} belongs to job {self.job_id!r}, not to this job {job_id!r} (a record left by another job)"
        return None


def read_endpoint(path: Path) -> EndpointRecord:
    """The record at `path`, as `EndpointRecord.write` wrote it.

    Raises:
        FileNotFoundError: no record yet. OSError: unreadable.
        EndpointRecordError: not JSON, not an object, or a key missing or of the wrong type (named).
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise EndpointRecordError(f"{path} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise EndpointRecordError(f"{path} is not a JSON object")
    role = data.get("role")
    if role not in ROLES:
        raise EndpointRecordError(f"{path}: role {role!r}; expected one of {', '.join(ROLES)}")
    own = ("teacher_id", "replica", "fingerprint") if role == "teacher" else ("index", "backend")
    missing = [k for k in ("host", "port", "pid", "job_id", "model_path", *own) if k not in data]
    if missing:
        raise EndpointRecordError(f"{path}: no {', '.join(missing)} (a {role} record has them)")
    record = EndpointRecord(
        role, **{k: data[k] for k in ("host", "port", "pid", "job_id", "model_path", *own)}
    )
    types = {"host": str, "port": int, "pid": int, "model_path": str, "teacher_id": str, "replica": int}
    types |= {"fingerprint": str, "index": int, "backend": str}
    wrong = [
        f"{k}={data[k]!r}"
        for k in ("host", "port", "pid", "model_path", *own)
        if not isinstance(data[k], types[k]) or isinstance(data[k], bool)
    ]
    if data["job_id"] is not None and not isinstance(data["job_id"], str):
        wrong.append(f"job_id={data['job_id']!r}")
    if wrong:
        raise EndpointRecordError(f"{path}: {', '.join(wrong)} (of the wrong type)")
    return record
