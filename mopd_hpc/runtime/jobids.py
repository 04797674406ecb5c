"""Slurm job ids and states: het ids `123+N` folded to the leader `123`, states through one table.

Slurm reports each component of a het job as its own record, `<leader>+<offset>` (sacct/squeue), and steps
as `<id>.<step>` (`123+1.0`, `123.batch`, `123.extern`); submitit keys jobs by the printed id and so never
matches `123+0` to the `123` that sbatch returned (launchers.md §1.1). Here every id is parsed by
`SlurmJobId.parse`, states go through `SLURM_STATES` (pattern of torchx `SLURM_STATES` +
`appstate_from_slurm_state`; anything unknown → `JobState.UNKNOWN`), and `query_status` asks `sacct
--parsable2` first and falls back to `squeue` (clusters without accounting; STYLE.md rule 7).
"""

from __future__ import annotations

import enum
import re
import subprocess
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

#: The sacct columns `parse_sacct` needs (any extra columns are ignored; order does not matter).
#: Slurm 22.05 has no `Restarts` column (`Invalid field requested`); requeues show as repeated rows of
#: `--duplicates` instead.
SACCT_COLUMNS = ("JobID", "JobName", "State", "ExitCode", "NodeList")
#: The squeue output format `parse_squeue` reads: id, full state name, node list, reason.
SQUEUE_FORMAT = "%i|%T|%N|%r"
#: Seconds a sacct/squeue call may take before it counts as failed.
COMMAND_TIMEOUT_S = 60

_JOB_ID = re.compile(
    r"^(?P<base>[0-9]+)(?:_(?P<array>[0-9]+|\[[^\]]*\]))?(?:\+(?P<offset>[0-9]+))?(?:\.(?P<step>[A-Za-z0-9_+-]+))?$"
)


class JobIdError(ValueError):
    """Text that is not a Slurm job id."""


class JobState(enum.StrEnum):
    """What a job or component is doing, coarser than Slurm's states (torchx `AppState`)."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    UNKNOWN = "UNKNOWN"

    @property
    def is_terminal(self) -> bool:
        """Whether the job will not change state any more (short of a requeue)."""
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


#: Slurm job state (full name, sacct/squeue `%T`) → JobState. Source: squeue.1 "JOB STATE CODES".
SLURM_STATES: dict[str, JobState] = {
    "BOOT_FAIL": JobState.FAILED,
    "CANCELLED": JobState.CANCELLED,
    "COMPLETED": JobState.SUCCEEDED,
    "COMPLETING": JobState.RUNNING,
    "CONFIGURING": JobState.PENDING,
    "DEADLINE": JobState.FAILED,
    "FAILED": JobState.FAILED,
    "LAUNCH_FAILED": JobState.FAILED,
    "NODE_FAIL": JobState.FAILED,
    "OUT_OF_MEMORY": JobState.FAILED,
    "PENDING": JobState.PENDING,
    "POWER_UP_NODE": JobState.PENDING,
    "PREEMPTED": JobState.FAILED,
    "REQUEUED": JobState.PENDING,
    "REQUEUE_FED": JobState.PENDING,
    "REQUEUE_HOLD": JobState.PENDING,
    "RESIZING": JobState.RUNNING,
    "RESV_DEL_HOLD": JobState.PENDING,
    "REVOKED": JobState.CANCELLED,
    "RUNNING": JobState.RUNNING,
    "SIGNALING": JobState.RUNNING,
    "SPECIAL_EXIT": JobState.FAILED,
    "STAGE_OUT": JobState.RUNNING,
    "STOPPED": JobState.RUNNING,
    "SUSPENDED": JobState.PENDING,
    "TIMEOUT": JobState.FAILED,
}
#: squeue's compact codes (`%t`) → full names (squeue.1 "JOB STATE CODES").
SQUEUE_CODES: dict[str, str] = {
    "BF": "BOOT_FAIL",
    "CA": "CANCELLED",
    "CD": "COMPLETED",
    "CF": "CONFIGURING",
    "CG": "COMPLETING",
    "DL": "DEADLINE",
    "F": "FAILED",
    "NF": "NODE_FAIL",
    "OOM": "OUT_OF_MEMORY",
    "PD": "PENDING",
    "PR": "PREEMPTED",
    "R": "RUNNING",
    "RD": "RESV_DEL_HOLD",
    "RF": "REQUEUE_FED",
    "RH": "REQUEUE_HOLD",
    "RQ": "REQUEUED",
    "RS": "RESIZING",
    "RV": "REVOKED",
    "SE": "SPECIAL_EXIT",
    "SI": "SIGNALING",
    "SO": "STAGE_OUT",
    "ST": "STOPPED",
    "S": "SUSPENDED",
    "TO": "TIMEOUT",
}


def state_from_slurm(raw: str) -> JobState:
    """Map a Slurm state as printed ("RUNNING", "CANCELLED by 1000", "CANCELLED+", "CG") to a JobState.

    Unknown text → `JobState.UNKNOWN` (never an error: Slurm adds states between versions).
    """
    words = raw.strip().split()
    if not words:
        return JobState.UNKNOWN
    name = words[0].rstrip("+").upper()
    name = SQUEUE_CODES.get(name, name)
    return SLURM_STATES.get(name, JobState.UNKNOWN)


@dataclass(frozen=True, slots=True)
class SlurmJobId:
    """A parsed Slurm id: `123`, `123+1` (het component), `123_4` (array task), `123+1.0`/`123.batch` (steps).

    Attributes:
        base: the numeric id before any suffix ("123"); for a het job, the leader's id.
        array: the array task ("4", or "[1-3%2]" for a pending range); None outside arrays.
        het_offset: the het component offset (1 in "123+1"); None outside het jobs.
        step: the step ("0", "batch", "extern"); None for the job record itself.
    """

    base: str
    array: str | None = None
    het_offset: int | None = None
    step: str | None = None

    @classmethod
    def parse(cls, text: str) -> SlurmJobId:
        """Parse `text` as printed by sbatch, sacct or squeue.

        Raises:
            JobIdError: `text` is not a job id; the message quotes it.
        """
        match = _JOB_ID.match(text.strip())
        if match is None:
            raise JobIdError(
                f"not a Slurm job id: {text!r}; expected forms 123, 123+1, 123_4, 123+1.0, 123.batch"
            )
        offset = match["offset"]
        return cls(
            base=match["base"],
            array=match["array"],
            het_offset=int(offset) if offset is not None else None,
            step=match["step"],
        )

    @property
    def leader(self) -> str:
        """The id that names the whole job: het offset and step dropped ("123+1.0" → "123", "7_2" → "7_2")."""
        return self.base if self.array is None else f"{self.base}_{self.array}"

    @property
    def component(self) -> str:
        """The job record this id belongs to, step dropped ("123+1.0" → "123+1")."""
        return self.leader if self.het_offset is None else f"{self.leader}+{self.het_offset}"


def fold_job_id(text: str) -> str:
    """The leader id of any Slurm id: "123+1" → "123", "123+0.batch" → "123", "123" → "123".

    Raises:
        JobIdError: `text` is not a job id.
    """
    return SlurmJobId.parse(text).leader


@dataclass(frozen=True, slots=True)
class RecordStatus:
    """One row of sacct/squeue: a job component (`step` is None) or one of its steps.

    Attributes:
        job_id: the parsed id.
        raw_state: the state as Slurm printed it ("CANCELLED by 0").
        state: `state_from_slurm(raw_state)`.
        exit_code: "code:signal" as sacct prints it; None from squeue.
        node_list: Slurm's compressed node list ("n[2-3]"); None when none is assigned.
        name: the job or step name (sacct JobName); None from squeue.
        reason: squeue's pending/finish reason; None from sacct.
    """

    job_id: SlurmJobId
    raw_state: str
    state: JobState
    exit_code: str | None = None
    node_list: str | None = None
    name: str | None = None
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class JobStatus:
    """Everything Slurm reports about one job, het components folded under the leader id.

    Attributes:
        leader: the leader's id ("123").
        source: "sacct", "squeue", or "none" (neither knew the job).
        components: one record per job component (one for a plain job, one per het group), by offset.
        steps: the step records (`.batch`, `.extern`, `.0`, ...), in the order printed.
    """

    leader: str
    source: str
    components: tuple[RecordStatus, ...] = ()
    steps: tuple[RecordStatus, ...] = ()

    @property
    def state(self) -> JobState:
        """The job's state: terminal only when every component is (FAILED > CANCELLED > SUCCEEDED),
        else RUNNING if any component runs, else PENDING if any waits; UNKNOWN without records."""
        states = [c.state for c in self.components]
        if not states:
            return JobState.UNKNOWN
        if all(s.is_terminal for s in states):
            for verdict in (JobState.FAILED, JobState.CANCELLED):
                if verdict in states:
                    return verdict
            return JobState.SUCCEEDED
        for verdict in (JobState.RUNNING, JobState.PENDING):
            if verdict in states:
                return verdict
        return JobState.UNKNOWN

    def component(self, het_offset: int) -> RecordStatus:
        """The record of het component `het_offset` (0 for a plain job).

        Raises:
            KeyError: no such component was reported.
        """
        for record in self.components:
            if (record.job_id.het_offset or 0) == het_offset:
                return record
        raise KeyError(f"job {self.leader} has no component +{het_offset} (reported: {self.components})")


class SacctParseError(ValueError):
    """sacct output without the `--parsable2` header the parser needs."""


def sacct_rows(text: str) -> list[tuple[SlurmJobId, dict[str, str]]]:
    """The one parser of `sacct --parsable2` output (a header line, then `|`-separated rows): each row's
    JobID parsed and its columns by header name, in sacct's order. Rows whose JobID is not an id are skipped.

    Raises:
        SacctParseError: the header lacks a JobID or State column.
    """
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return []
    header = lines[0].split("|")
    if "JobID" not in header or "State" not in header:
        raise SacctParseError(
            f"sacct output header {lines[0]!r}: expected --parsable2 columns including JobID and State"
        )
    rows = []
    for line in lines[1:]:
        row = dict(zip(header, line.split("|"), strict=False))
        try:
            rows.append((SlurmJobId.parse(row.get("JobID", "")), row))
        except JobIdError:
            continue
    return rows


def parse_sacct(text: str) -> dict[str, JobStatus]:
    """Parse `sacct --parsable2` output (`sacct_rows`) into statuses by leader.

    With `--duplicates` a requeued job prints one row per incarnation; the last row of an id wins (sacct
    prints them oldest first).

    Raises:
        SacctParseError: the header lacks a JobID or State column.
    """
    rows = []
    for job_id, row in sacct_rows(text):
        raw = row.get("State", "")
        nodes = row.get("NodeList") or None
        rows.append(
            RecordStatus(
                job_id=job_id,
                raw_state=raw,
                state=state_from_slurm(raw),
                exit_code=row.get("ExitCode") or None,
                node_list=None if nodes == "None assigned" else nodes,
                name=row.get("JobName") or None,
            )
        )
    return _group(rows, "sacct")


def parse_squeue(text: str) -> dict[str, JobStatus]:
    """Parse `squeue --noheader --format=%i|%T|%N|%r` output into statuses by leader (no steps)."""
    rows = []
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) < 2:
            continue
        try:
            job_id = SlurmJobId.parse(fields[0])
        except JobIdError:
            continue
        raw = fields[1]
        nodes = fields[2] if len(fields) > 2 and fields[2] else None
        reason = fields[3] if len(fields) > 3 and fields[3] else None
        rows.append(
            RecordStatus(
                job_id=job_id, raw_state=raw, state=state_from_slurm(raw), node_list=nodes, reason=reason
            )
        )
    return _group(rows, "squeue")


def sacct_command(leaders: Iterable[str]) -> list[str]:
    """The sacct call for `leaders` (a leader id selects every het component: `--whole-hetjob` default)."""
    return ["sacct", "--parsable2", f"--format={','.join(SACCT_COLUMNS)}", f"--jobs={','.join(leaders)}"]


def squeue_command(leaders: Iterable[str]) -> list[str]:
    """The squeue call for `leaders`, finished jobs included while slurmctld still remembers them."""
    return [
        "squeue",
        "--noheader",
        "--states=all",
        f"--format={SQUEUE_FORMAT}",
        f"--jobs={','.join(leaders)}",
    ]


def run_command(argv: Sequence[str]) -> str:
    """Run `argv` and return its stdout (the default runner of `query_status`).

    Raises:
        OSError: the program is missing. subprocess.CalledProcessError: it exited non-zero.
        subprocess.TimeoutExpired: it ran longer than COMMAND_TIMEOUT_S.
    """
    done = subprocess.run(list(argv), capture_output=True, text=True, check=True, timeout=COMMAND_TIMEOUT_S)
    return done.stdout


def query_status(leader: str, run: Callable[[Sequence[str]], str] = run_command) -> JobStatus:
    """The status of job `leader` from sacct, else from squeue, else `source="none"` (state UNKNOWN).

    sacct fails without accounting ("Slurm accounting storage is disabled") and knows a job only some
    seconds after submission; squeue forgets it MinJobAge after it ends.

    Args:
        leader: any id of the job; it is folded to the leader first.
        run: runs an argv and returns stdout, raising on failure (injected in tests).
    """
    leader = fold_job_id(leader)
    for command, parse in ((sacct_command([leader]), parse_sacct), (squeue_command([leader]), parse_squeue)):
        try:
            statuses = parse(run(command))
        except (OSError, subprocess.SubprocessError, ValueError):
            continue
        if leader in statuses and statuses[leader].components:
            return statuses[leader]
    return JobStatus(leader=leader, source="none")


def _group(rows: list[RecordStatus], source: str) -> dict[str, JobStatus]:
    components: dict[str, dict[str, RecordStatus]] = {}
    steps: dict[str, dict[str, RecordStatus]] = {}
    for row in rows:
        leader = row.job_id.leader
        target = components if row.job_id.step is None else steps
        key = row.job_id.component if row.job_id.step is None else f"{row.job_id.component}.{row.job_id.step}"
        target.setdefault(leader, {})[key] = row  # the last row of an id wins
    result = {}
    for leader in {**components, **steps}:
        comps = sorted(components.get(leader, {}).values(), key=lambda r: r.job_id.het_offset or 0)
        result[leader] = JobStatus(
            leader=leader,
            source=source,
            components=tuple(comps),
            steps=tuple(steps.get(leader, {}).values()),
        )
    return result
