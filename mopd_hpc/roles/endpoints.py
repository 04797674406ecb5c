"""Wait for the servers of the job: teacher and rollout endpoint files, each answering its health probe.

Each replica of a teacher writes `run_dir/endpoints/teacher-<id>.r<replica>.json` and a rollout engine
`run_dir/endpoints/rollout-<index>.json` once they listen. An endpoint counts as ready when its file exists,
names this job (`job_id` equal to this job's: a record of another job — a file left by an earlier job of the
same run directory — or one without a job id, such as a standalone server's, is never accepted), and its
server answers GET /health. Past the deadline, `EndpointTimeoutError` names every endpoint still missing and
why (no file, another job — naming both ids —, no job id, no answer), with the child log paths to look at.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from mopd_hpc.records.endpoint import EndpointRecordError, read_endpoint
from mopd_hpc.records.run_dir import LOGS_DIR, endpoint_file, teacher_endpoint_file
from mopd_hpc.runtime import child_env

#: Default deadline for every server to be up, in seconds (model loading included).
DEFAULT_TIMEOUT_S = 600.0
#: Poll period, seconds.
POLL_S = 0.2


def endpoint_timeout_s(environ: Mapping[str, str]) -> float:
    """The deadline for the job's servers, seconds: child_env.ENDPOINT_TIMEOUT_S of `environ`, else DEFAULT_TIMEOUT_S.

    Raises:
        ValueError: the variable is set but not a number.
    """
    return float(environ.get(child_env.ENDPOINT_TIMEOUT_S) or DEFAULT_TIMEOUT_S)


@dataclass(frozen=True, slots=True)
class Endpoints:
    """Where the servers of the job listen: rollout engine URLs (by index) and, per teacher id, the URLs of
    its replicas (by replica index)."""

    rollout: tuple[str, ...]
    teachers: Mapping[str, tuple[str, ...]]


class EndpointTimeoutError(RuntimeError):
    """A server of the job did not come up before the deadline (the message names each and why)."""


async def _probe(url: str) -> bool:
    try:
        timeout = aiohttp.ClientTimeout(total=5.0)
        async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url + "/health") as resp:
            return resp.status == 200
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False


async def _ready(path: Path, job_id: str) -> tuple[str | None, str]:
    """(url, "") when ready, else (None, why not)."""
    try:
        record = read_endpoint(path)
    except FileNotFoundError:
        return None, f"no file {path}"
    except EndpointRecordError as exc:
        return None, str(exc)
    except OSError as exc:
        return None, f"unreadable {path}: {exc}"
    problem = record.job_problem(path, job_id)
    if problem is not None:
        return None, problem
    url = record.url
    if not await _probe(url):
        return None, f"{url}/health does not answer (file {path})"
    return url, ""


async def wait_for_endpoints(
    run_dir: Path,
    teachers: Mapping[str, int],
    rollout_count: int,
    job_id: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Endpoints:
    """Wait until every replica 0..n-1 of each teacher of `teachers` (teacher id → n replicas,
    `config.parallel.teacher_replicas`) and rollout engines 0..rollout_count-1 are ready for job `job_id`.

    Raises:
        EndpointTimeoutError: past `timeout_s`, naming what is missing and where the child logs are.
    """
    wanted = {
        ("teacher", f"{t}.r{r}"): teacher_endpoint_file(run_dir, t, r)
        for t, n in teachers.items()
        for r in range(n)
    }
    wanted |= {("rollout", str(i)): endpoint_file(run_dir, "rollout", str(i)) for i in range(rollout_count)}
    found: dict[tuple[str, str], str] = {}
    why: dict[tuple[str, str], str] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        for key, path in wanted.items():
            if key not in found:
                url, reason = await _ready(path, job_id)
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
        teachers={t: tuple(found[("teacher", f"{t}.r{r}")] for r in range(n)) for t, n in teachers.items()},
    )
