"""Wait for the servers of the job: teacher and rollout endpoint files, each answering its health probe.

A teacher child writes `run_dir/endpoints/teacher-<id>.json` and a rollout engine
`run_dir/endpoints/rollout-<index>.json` once they listen. An endpoint counts as ready when its file exists,
names this job (rollout records carry `job_id`; a file left by an earlier job of the same run directory is
not), and its server answers GET /health. Past the deadline, `EndpointTimeoutError` names every endpoint
still missing and why (no file, wrong job, no answer), with the child log paths to look at.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from mopd_hpc.records.run_dir import LOGS_DIR, endpoint_file

#: Default deadline for every server to be up, in seconds (model loading included).
DEFAULT_TIMEOUT_S = 600.0
#: Poll period, seconds.
POLL_S = 0.2


@dataclass(frozen=True, slots=True)
class Endpoints:
    """Where the servers of the job listen: rollout engine URLs (by index) and teacher URLs (by id)."""

    rollout: tuple[str, ...]
    teachers: Mapping[str, str]


class EndpointTimeoutError(RuntimeError):
    """A server of the job did not come up before the deadline (the message names each and why)."""


async def _probe(url: str) -> bool:
    try:
        timeout = aiohttp.ClientTimeout(total=5.0)
        async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url + "/health") as resp:
            return resp.status == 200
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False


async def _ready(path: Path, job_id: str | None) -> tuple[str | None, str]:
    """(url, "") when ready, else (None, why not)."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, f"no file {path}"
    except (OSError, ValueError) as exc:
        return None, f"unreadable {path}: {exc}"
    if job_id is not None and record.get("job_id") not in (None, job_id):
        return None, f"{path} belongs to job {record.get('job_id')!r}, not {job_id!r}"
    url = record.get("url") or f"http://{record['host']}:{int(record['port'])}"
    if not await _probe(url):
        return None, f"{url}/health does not answer (file {path})"
    return url, ""


async def wait_for_endpoints(
    run_dir: Path,
    teacher_ids: Sequence[str],
    rollout_count: int,
    job_id: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Endpoints:
    """Wait until every teacher of `teacher_ids` and rollout engines 0..rollout_count-1 are ready.

    Raises:
        EndpointTimeoutError: past `timeout_s`, naming what is missing and where the child logs are.
    """
    wanted = {("teacher", t): endpoint_file(run_dir, "teacher", t) for t in teacher_ids}
    wanted |= {("rollout", str(i)): endpoint_file(run_dir, "rollout", str(i)) for i in range(rollout_count)}
    found: dict[tuple[str, str], str] = {}
    why: dict[tuple[str, str], str] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        for key, path in wanted.items():
            if key not in found:
                url, reason = await _ready(path, job_id if key[0] == "rollout" else None)
                if url is not None:
                    found[key] = url
                else:
                    why[key] = reason
        if len(found) == len(wanted):
            break
        if time.monotonic() > deadline:
            missing = "; ".join(
                f"{role} {key}: {why[(role, key)]}" for role, key in wanted if (role, key) not in found
            )
            raise EndpointTimeoutError(
                f"servers not ready after {timeout_s:.0f} s: {missing}. Their logs: {run_dir / LOGS_DIR}/<host>/"
                "<role>-<index>.g<generation>.err"
            )
        await asyncio.sleep(POLL_S)
    return Endpoints(
        rollout=tuple(found[("rollout", str(i))] for i in range(rollout_count)),
        teachers={t: found[("teacher", t)] for t in teacher_ids},
    )
