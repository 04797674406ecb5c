"""What Slurm accounting says about a job: components (het `123+N` folded under `123`), states, requeues.

One call, `sacct --parsable2 --duplicates` with `SACCT_FIELDS` (a recipe from launchers.md §4.4 trimmed to
fields Slurm 22.05 has: it has no `Restarts` column). `--duplicates` prints one job row per incarnation of a
requeued job, oldest first, each followed by its steps; the number of incarnations minus one is the requeue
count. Ids and states go through `mopd_hpc.runtime.jobids` (one table for the project: `SlurmJobId.parse`,
`state_from_slurm`). Tested on text recorded from the local Slurm 22.05 cluster (tests/data/logs/sacct/).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mopd_hpc.runtime.jobids import fold_job_id, sacct_rows, state_from_slurm

#: The columns asked for (all exist in Slurm 22.05; order does not matter to the parser).
SACCT_FIELDS = (
    "JobID",
    "JobName",
    "State",
    "ExitCode",
    "DerivedExitCode",
    "Reason",
    "Submit",
    "Start",
    "End",
    "Elapsed",
    "Timelimit",
    "NNodes",
    "NodeList",
    "AllocTRES",
)
#: Seconds sacct may take.
SACCT_TIMEOUT_S = 30
#: A runner takes an argv and returns stdout, raising on failure (subprocess in production, a fake in tests).
SacctRunner = Callable[[Sequence[str]], str]


@dataclass(frozen=True, slots=True)
class SacctStep:
    """One step row (`123+1.0`, `123.batch`)."""

    step_id: str
    name: str
    state: str
    exit_code: str
    node_list: str
    elapsed: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "step_id": self.step_id,
            "name": self.name,
            "state": self.state,
            "exit_code": self.exit_code,
            "node_list": self.node_list,
            "elapsed": self.elapsed,
        }


@dataclass(frozen=True, slots=True)
class SacctComponent:
    """The last incarnation of one job component (`het_offset` 0 for a plain job).

    Attributes:
        state: as Slurm printed it ("CANCELLED by 0", "TIMEOUT"); `coarse_state` is the project's JobState.
        incarnations: how many times it ran (1 + requeues), from `--duplicates` rows.
        steps: the steps of the last incarnation.
    """

    component_id: str
    het_offset: int
    name: str
    state: str
    coarse_state: str
    exit_code: str
    derived_exit_code: str
    reason: str
    start: str
    end: str
    elapsed: str
    time_limit: str
    node_list: str
    alloc_tres: str
    incarnations: int
    steps: tuple[SacctStep, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "component_id": self.component_id,
            "het_offset": self.het_offset,
            "name": self.name,
            "state": self.state,
            "coarse_state": self.coarse_state,
            "exit_code": self.exit_code,
            "derived_exit_code": self.derived_exit_code,
            "reason": self.reason,
            "start": self.start,
            "end": self.end,
            "elapsed": self.elapsed,
            "time_limit": self.time_limit,
            "node_list": self.node_list,
            "alloc_tres": self.alloc_tres,
            "incarnations": self.incarnations,
            "steps": [s.to_dict() for s in self.steps],
        }


@dataclass(frozen=True, slots=True)
class SacctJob:
    """Every component of one job (leader id), in het-offset order; `requeues` = max incarnations − 1."""

    leader: str
    components: tuple[SacctComponent, ...]

    @property
    def requeues(self) -> int:
        return max((c.incarnations for c in self.components), default=1) - 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "leader": self.leader,
            "requeues": self.requeues,
            "components": [c.to_dict() for c in self.components],
        }


def sacct_command(job_id: str) -> list[str]:
    """The sacct argv for `job_id` (folded to its leader; `--whole-hetjob` is the default for a leader)."""
    return [
        "sacct",
        "--parsable2",
        "--duplicates",
        f"--format={','.join(SACCT_FIELDS)}",
        f"--jobs={fold_job_id(job_id)}",
    ]


def run_sacct(argv: Sequence[str]) -> str:
    """The default runner: run sacct, return stdout (raises OSError/CalledProcessError/TimeoutExpired)."""
    return subprocess.run(
        list(argv), capture_output=True, text=True, check=True, timeout=SACCT_TIMEOUT_S
    ).stdout


def parse_sacct_jobs(text: str) -> dict[str, SacctJob]:
    """Parse `sacct --parsable2 [--duplicates]` text into jobs by leader id; het components are folded.

    The rows come from `runtime/jobids.py` `sacct_rows` (the project's one sacct parser).

    Raises:
        SacctParseError: the first line is not a header with JobID and State.
    """
    rows: dict[str, dict[str, dict[str, Any]]] = {}  # leader → component id → accumulated record
    for jid, row in sacct_rows(text):
        comp = rows.setdefault(jid.leader, {}).setdefault(jid.component, {"n": 0, "row": None, "steps": {}})
        if jid.step is None:
            comp["n"] += 1
            comp["row"] = row
            comp["offset"] = jid.het_offset or 0
            comp["steps"] = {}  # a new incarnation: its steps follow
        else:
            comp["steps"][jid.step] = SacctStep(
                step_id=f"{jid.component}.{jid.step}",
                name=row.get("JobName", ""),
                state=row.get("State", ""),
                exit_code=row.get("ExitCode", ""),
                node_list=row.get("NodeList", ""),
                elapsed=row.get("Elapsed", ""),
            )
    jobs = {}
    for leader, comps in rows.items():
        built = [_component(cid, c) for cid, c in comps.items() if c["row"] is not None]
        jobs[leader] = SacctJob(leader, tuple(sorted(built, key=lambda c: c.het_offset)))
    return jobs


def _component(component_id: str, acc: dict[str, Any]) -> SacctComponent:
    row = acc["row"]
    return SacctComponent(
        component_id=component_id,
        het_offset=acc["offset"],
        name=row.get("JobName", ""),
        state=row.get("State", ""),
        coarse_state=str(state_from_slurm(row.get("State", ""))),
        exit_code=row.get("ExitCode", ""),
        derived_exit_code=row.get("DerivedExitCode", ""),
        reason=row.get("Reason", ""),
        start=row.get("Start", ""),
        end=row.get("End", ""),
        elapsed=row.get("Elapsed", ""),
        time_limit=row.get("Timelimit", ""),
        node_list=row.get("NodeList", ""),
        alloc_tres=row.get("AllocTRES", ""),
        incarnations=acc["n"],
        steps=tuple(acc["steps"].values()),
    )


def query_sacct(job_id: str, runner: SacctRunner = run_sacct) -> SacctJob | None:
    """The job as sacct reports it, or None when sacct is missing, fails (no accounting) or does not know it."""
    try:
        jobs = parse_sacct_jobs(runner(sacct_command(job_id)))
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return jobs.get(fold_job_id(job_id))
