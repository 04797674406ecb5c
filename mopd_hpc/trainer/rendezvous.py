"""The actor group's rendezvous record: where rank 0's store listens, published in the run directory.

Rank 0 of the actor group leases the named port `master` on its node (the plan gives it to rank 0 only), so
the other ranks, on other nodes, cannot know it: rank 0 writes `run_dir/endpoints/actor-rendezvous.json`

    {"job_id", "host", "port", "world_size", "nonce", "ts"}

atomically once its store listens (host: the address it advertises, loopback locally, the node's address
on a cluster), and every other rank waits for it (`wait_for_rendezvous`). A record counts only when it
names the rank's own job and world size: a file left by an earlier job of the same run directory does not.
A requeued Slurm job keeps its job id, so a stale record of the run before the requeue can name the same
job: the `nonce` (random, per run of rank 0) is also set in the store itself, and a rank that connects to a
store whose nonce differs (another job now owns that port) or to no store reads the file again
(`connect_store`).
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

log = logging.getLogger("mopd_hpc.trainer")

#: The record, under the run directory (beside the servers' endpoint files).
RENDEZVOUS_FILE = "endpoints/actor-rendezvous.json"
#: How often a waiting rank reads the file, seconds.
POLL_S = 0.1
#: The store key rank 0 sets to the record's nonce before it publishes the record.
NONCE_KEY = "mopd_actor/nonce"
#: How long one attempt to reach rank 0's store may take before the file is read again, seconds.
CONNECT_ATTEMPT_S = 15.0


class RendezvousTimeoutError(RuntimeError):
    """No valid rendezvous record appeared in time (the message says what the file held, if anything), or
    the store it names is not this run's."""


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


def rendezvous_path(run_dir: Path) -> Path:
    return Path(run_dir) / RENDEZVOUS_FILE


def write_rendezvous(run_dir: Path, record: Rendezvous) -> Path:
    """Publish `record` (atomic: a reader sees the old file or the new one)."""
    path = rendezvous_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, asdict(record))
    return path


def read_rendezvous(run_dir: Path, job_id: str, world_size: int) -> tuple[Rendezvous | None, str]:
    """(the record, "") when the file holds one of job `job_id` and world `world_size`, else (None, why)."""
    path = rendezvous_path(run_dir)
    try:
        record = Rendezvous.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except FileNotFoundError:
        return None, f"no file {path}"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"unreadable {path}: {exc}"
    if record.job_id != job_id:
        return None, f"{path} belongs to job {record.job_id!r}, not {job_id!r}"
    if record.world_size != world_size:
        return None, f"{path} is for an actor world of {record.world_size} ranks, not {world_size}"
    return record, ""


def wait_for_rendezvous(
    run_dir: Path,
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
        record, why = read_rendezvous(run_dir, job_id, world_size)
        if record is not None and record.nonce != not_nonce:
            return record
        if record is not None:
            why = f"{rendezvous_path(run_dir)} still names the store with nonce {not_nonce}, which is gone"
        if time.monotonic() > deadline:
            raise RendezvousTimeoutError(
                f"actor rank 0's rendezvous record did not appear within {timeout_s:.0f} s: {why}. Rank 0 "
                f"writes it once its store listens; its log: {Path(run_dir) / 'logs'}/<host>/actor-0.g1.err"
            )
        time.sleep(poll_s)


def connect_store(run_dir: Path, job_id: str, world_size: int, timeout_s: float) -> tuple[Any, Rendezvous]:
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
        record = wait_for_rendezvous(run_dir, job_id, world_size, left, not_nonce=stale)
        attempt = min(CONNECT_ATTEMPT_S, left)
        try:
            store = tcp_store(record.host, record.port, world_size, is_master=False, timeout_s=attempt)
            nonce = store.get(NONCE_KEY).decode()
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
                f"rank 0's store {record.host}:{record.port} named by {rendezvous_path(run_dir)} is not this "
                f"run's (nonce {nonce!r}, expected {record.nonce!r}) and no newer record came in {timeout_s:.0f} s"
            )
