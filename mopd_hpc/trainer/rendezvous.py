"""A group's rendezvous record: where its rank 0's store listens, published in the run directory.

Rank 0 of a group leases the named port `master` on its node (the plan gives it to rank 0 only), so the other
ranks, on other nodes, cannot know it: rank 0 writes the group's record (`RendezvousFile`)

    {"job_id", "host", "port", "world_size", "nonce", "ts"}

atomically once its store listens (`publish_store`; host: the address it advertises, loopback locally, the
node's address on a cluster), and every other rank waits for it (`wait_for_rendezvous`). Two groups use it:
the actor group (`run_dir/endpoints/actor-rendezvous.json`, trainer/actor_group.py) and each tensor-parallel
teacher replica (`run_dir/endpoints/teacher-<id>.r<replica>-rendezvous.json`, its leader's store;
roles/teacher_replica.py). A record counts only when it names the rank's own job and world size: a file left
by an earlier job of the same run directory does not. A requeued Slurm job keeps its job id, so a stale record
of the run before the requeue can name the same job: the `nonce` (random, per run of rank 0) is also set in
the store itself, and a rank that connects to a store whose nonce differs (another job now owns that port) or
to no store reads the file again (`connect_store`).
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mopd_hpc.atomic import atomic_write_json
from mopd_hpc.engines.tcp_store import tcp_store
from mopd_hpc.records.run_dir import LOGS_DIR, actor_rendezvous_file, teacher_rendezvous_file

log = logging.getLogger("mopd_hpc.trainer")

#: How often a waiting rank reads the file, seconds.
POLL_S = 0.1
#: The store key the actor group's rank 0 sets to the record's nonce before it publishes the record.
NONCE_KEY = "mopd_actor/nonce"
#: The same key in a teacher replica leader's store.
TEACHER_NONCE_KEY = "mopd_teacher/nonce"
#: How long one attempt to reach rank 0's store may take before the file is read again, seconds.
CONNECT_ATTEMPT_S = 15.0


class RendezvousTimeoutError(RuntimeError):
    """No valid rendezvous record appeared in time (the message says what the file held, if anything), or
    the store it names is not this run's."""


@dataclass(frozen=True, slots=True)
class RendezvousFile:
    """Where one group's rendezvous record lives, and how messages name it. Build with `actor` or `teacher`.

    Attributes:
        path: the record file (under run_dir/endpoints, beside the servers' endpoint records).
        world: the group, as "is for <world> of N ranks" names it ("an actor world").
        writer: the rank that writes it ("actor rank 0").
        writer_log: where that rank logs (for the timeout's message).
        nonce_key: the store key the writer sets to the record's nonce.
    """

    path: Path
    world: str
    writer: str
    writer_log: str
    nonce_key: str

    @classmethod
    def actor(cls, run_dir: Path) -> RendezvousFile:
        """The actor group's record, `run_dir/endpoints/actor-rendezvous.json`."""
        log_hint = f"{Path(run_dir) / LOGS_DIR}/<host>/actor-0.g1.err"
        return cls(actor_rendezvous_file(run_dir), "an actor world", "actor rank 0", log_hint, NONCE_KEY)

    @classmethod
    def teacher(cls, run_dir: Path, teacher_id: str, replica: int) -> RendezvousFile:
        """The TP group of replica `replica` of teacher `teacher_id`: its leader's record,
        `run_dir/endpoints/teacher-<id>.r<replica>-rendezvous.json`."""
        name = f"teacher {teacher_id} replica {replica}"
        return cls(
            teacher_rendezvous_file(run_dir, teacher_id, replica),
            f"a TP group of {name}",
            f"the leader of {name}",
            f"{Path(run_dir) / LOGS_DIR}/<host>/teacher-<leader index>.g<generation>.err",
            TEACHER_NONCE_KEY,
        )


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Rank 0's store address. Build with `Rendezvous.create` (rank 0) or `from_dict` (a file)."""

    job_id: str
    host: str
    port: int
    world_size: int
    nonce: str
    ts: float

    @classmethod
    def create(cls, job_id: str, host: str, port: int, world_size: int) -> Rendezvous:
        """A new record with a fresh nonce and the current time."""
        return cls(job_id, host, int(port), int(world_size), secrets.token_hex(8), time.time())

    @classmethod
    def from_dict(cls, data: dict) -> Rendezvous:
        """Raises KeyError/TypeError/ValueError for a malformed record."""
        return cls(
            str(data["job_id"]),
            str(data["host"]),
            int(data["port"]),
            int(data["world_size"]),
            str(data["nonce"]),
            float(data["ts"]),
        )


def publish_store(
    file: RendezvousFile,
    job_id: str,
    host: str,
    port: int,
    world_size: int,
    timeout_s: float,
    initial: dict[str, str] | None = None,
) -> tuple[Any, Rendezvous]:
    """Rank 0: its TCP store listening on (host, port) (`engines/tcp_store.py`: that address only), a new
    record's nonce and the `initial` keys set in it, then the record published (`write_rendezvous`).

    Raises:
        OSError: the port cannot be bound.
    """
    store = tcp_store(host, port, world_size, is_master=True, timeout_s=timeout_s)
    record = Rendezvous.create(job_id, host, port, world_size)
    store.set(file.nonce_key, record.nonce)
    for key, value in (initial or {}).items():
        store.set(key, value)
    write_rendezvous(file, record)
    return store, record


def write_rendezvous(file: RendezvousFile, record: Rendezvous) -> Path:
    """Publish `record` (atomic: a reader sees the old file or the new one)."""
    file.path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(file.path, asdict(record))
    return file.path


def read_rendezvous(file: RendezvousFile, job_id: str, world_size: int) -> tuple[Rendezvous | None, str]:
    """(the record, "") when the file holds one of job `job_id` and world `world_size`, else (None, why)."""
    path = file.path
    try:
        record = Rendezvous.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except FileNotFoundError:
        return None, f"no file {path}"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"unreadable {path}: {exc}"
    if record.job_id != job_id:
        return None, f"{path} belongs to job {record.job_id!r}, not {job_id!r}"
    if record.world_size != world_size:
        return None, f"{path} is for {file.world} of {record.world_size} ranks, not {world_size}"
    return record, ""


def wait_for_rendezvous(
    file: RendezvousFile,
    job_id: str,
    world_size: int,
    timeout_s: float,
    *,
    not_nonce: str | None = None,
    poll_s: float = POLL_S,
) -> Rendezvous:
    """Block until `read_rendezvous` gives a record (other than one of nonce `not_nonce`, a record found
    stale already).

    Raises:
        RendezvousTimeoutError: none within `timeout_s`; names the file and why the last read failed.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        record, why = read_rendezvous(file, job_id, world_size)
        if record is not None and record.nonce != not_nonce:
            return record
        if record is not None:
            why = f"{file.path} still names the store with nonce {not_nonce}, which is gone"
        if time.monotonic() > deadline:
            raise RendezvousTimeoutError(
                f"{file.writer}'s rendezvous record did not appear within {timeout_s:.0f} s: {why}. It writes it "
                f"once its store listens; its log: {file.writer_log}"
            )
        time.sleep(poll_s)


def connect_store(
    file: RendezvousFile, job_id: str, world_size: int, timeout_s: float
) -> tuple[Any, Rendezvous]:
    """A rank > 0: a client of rank 0's TCP store, through the record of `job_id` whose nonce the store
    itself confirms (module docstring); a stale record is skipped until rank 0 rewrites it.

    Raises:
        RendezvousTimeoutError: no record of this job, or none whose store answers with its nonce, within
            `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    stale: str | None = None
    while True:
        left = max(1.0, deadline - time.monotonic())
        record = wait_for_rendezvous(file, job_id, world_size, left, not_nonce=stale)
        attempt = min(CONNECT_ATTEMPT_S, left)
        try:
            store = tcp_store(record.host, record.port, world_size, is_master=False, timeout_s=attempt)
            nonce = store.get(file.nonce_key).decode()
        except RuntimeError as exc:
            log.info(
                "rendezvous %s:%d (nonce %s) unreachable: %s", record.host, record.port, record.nonce, exc
            )
            nonce = None
        if nonce == record.nonce:
            return store, record
        stale = record.nonce
        if time.monotonic() > deadline:
            raise RendezvousTimeoutError(
                f"{file.writer}'s store {record.host}:{record.port} named by {file.path} is not this run's "
                f"(nonce {nonce!r}, expected {record.nonce!r}) and no newer record came in {timeout_s:.0f} s"
            )
