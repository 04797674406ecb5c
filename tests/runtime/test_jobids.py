"""Slurm ids and states: het ids folded to the leader, sacct/squeue parsed from recorded outputs.

The recorded texts below have the shape Slurm 22.05 prints (`sacct --parsable2`, `squeue --noheader
--format=%i|%T|%N|%r`) for het job 14 (components 14+0 on n1 and 14+1 on n[2-3], as in
slurm-local-findings.md §4), a colocated job 21, a pending job, and a requeued job seen with --duplicates.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

import pytest

from mopd_hpc.runtime.jobids import (
    SLURM_STATES,
    JobIdError,
    JobState,
    JobStatus,
    SlurmJobId,
    fold_job_id,
    parse_sacct,
    parse_squeue,
    query_status,
    sacct_command,
    squeue_command,
    state_from_slurm,
)

SACCT_HET_RUNNING = """\
JobID|JobName|State|ExitCode|NodeList
14+0|mopd-demo|RUNNING|0:0|n1
14+0.batch|batch|RUNNING|0:0|n1
14+0.extern|extern|RUNNING|0:0|n1
14+0.0|node.sh|RUNNING|0:0|n1
14+1|mopd-demo|RUNNING|0:0|n[2-3]
14+1.extern|extern|RUNNING|0:0|n[2-3]
14+1.1|node.sh|RUNNING|0:0|n[2-3]
"""
SACCT_HET_FAILED = """\
JobID|JobName|State|ExitCode|NodeList
14+0|mopd-demo|FAILED|3:0|n1
14+0.batch|batch|FAILED|3:0|n1
14+0.extern|extern|COMPLETED|0:0|n1
14+0.0|node.sh|CANCELLED by 0|0:15|n1
14+1|mopd-demo|FAILED|3:0|n[2-3]
14+1.extern|extern|COMPLETED|0:0|n[2-3]
14+1.1|node.sh|FAILED|3:0|n[2-3]
"""
SACCT_COLOCATED_DONE = """\
JobID|JobName|State|ExitCode|NodeList
21|mopd-colocated|COMPLETED|0:0|n1
21.batch|batch|COMPLETED|0:0|n1
21.extern|extern|COMPLETED|0:0|n1
21.0|node.sh|COMPLETED|0:0|n1
22|mopd-next|PENDING|0:0|None assigned
"""
SACCT_REQUEUED_DUPLICATES = """\
JobID|JobName|State|ExitCode|NodeList
30|mopd-demo|REQUEUED|0:0|n1
30.batch|batch|CANCELLED|0:15|n1
30.0|node.sh|COMPLETED|0:0|n1
30|mopd-demo|RUNNING|0:0|n1
30.batch|batch|RUNNING|0:0|n1
30.0|node.sh|RUNNING|0:0|n1
"""
SQUEUE_HET = """\
14+0|RUNNING|n1|None
14+1|RUNNING|n[2-3]|None
15+0|PENDING||Resources
15+1|PENDING||Resources
"""
SACCT_DISABLED = "Slurm accounting storage is disabled"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("123", SlurmJobId("123")),
        ("123+1", SlurmJobId("123", het_offset=1)),
        ("123+0.batch", SlurmJobId("123", het_offset=0, step="batch")),
        ("123+1.0", SlurmJobId("123", het_offset=1, step="0")),
        ("123.extern", SlurmJobId("123", step="extern")),
        ("20956421_[2-4%25]", SlurmJobId("20956421", array="[2-4%25]")),
        ("7_3.0", SlurmJobId("7", array="3", step="0")),
    ],
)
def test_parse_job_id(text: str, expected: SlurmJobId) -> None:
    assert SlurmJobId.parse(text) == expected


def test_fold_and_component() -> None:
    assert [fold_job_id(t) for t in ("123", "123+0", "123+1", "123+1.0", "123.batch")] == ["123"] * 5
    assert fold_job_id("7_3") == "7_3"
    assert SlurmJobId.parse("123+1.0").component == "123+1"
    assert SlurmJobId.parse("123.batch").component == "123"
    for bad in ("", "abc", "123+x", "Submitted batch job 123"):
        with pytest.raises(JobIdError, match="not a Slurm job id"):
            SlurmJobId.parse(bad)


@pytest.mark.parametrize(
    ("raw", "state"),
    [
        ("RUNNING", JobState.RUNNING),
        ("CANCELLED by 1000", JobState.CANCELLED),
        ("CANCELLED+", JobState.CANCELLED),
        ("COMPLETED", JobState.SUCCEEDED),
        ("OUT_OF_MEMORY", JobState.FAILED),
        ("TIMEOUT", JobState.FAILED),
        ("PREEMPTED", JobState.FAILED),
        ("REQUEUED", JobState.PENDING),
        ("PD", JobState.PENDING),
        ("CG", JobState.RUNNING),
        ("OOM", JobState.FAILED),
        ("SOMETHING_NEW", JobState.UNKNOWN),
        ("", JobState.UNKNOWN),
    ],
)
def test_state_table(raw: str, state: JobState) -> None:
    assert state_from_slurm(raw) is state


def test_state_table_covers_every_terminal_verdict() -> None:
    assert set(SLURM_STATES.values()) == set(JobState) - {JobState.UNKNOWN}


def test_sacct_het_running_folds_components() -> None:
    statuses = parse_sacct(SACCT_HET_RUNNING)
    assert list(statuses) == ["14"]
    status = statuses["14"]
    assert status.source == "sacct" and status.state is JobState.RUNNING
    assert [c.job_id.component for c in status.components] == ["14+0", "14+1"]
    assert status.component(1).node_list == "n[2-3]"
    assert [s.job_id.step for s in status.steps] == ["batch", "extern", "0", "extern", "1"]
    assert [s.job_id.het_offset for s in status.steps] == [0, 0, 0, 1, 1]


def test_sacct_het_failed() -> None:
    status = parse_sacct(SACCT_HET_FAILED)["14"]
    assert status.state is JobState.FAILED
    assert [c.exit_code for c in status.components] == ["3:0", "3:0"]
    steps = {f"{s.job_id.component}.{s.job_id.step}": s for s in status.steps}
    assert steps["14+0.0"].raw_state == "CANCELLED by 0" and steps["14+0.0"].state is JobState.CANCELLED
    assert steps["14+1.1"].state is JobState.FAILED and steps["14+1.1"].name == "node.sh"


def test_sacct_plain_and_pending_jobs() -> None:
    statuses = parse_sacct(SACCT_COLOCATED_DONE)
    assert statuses["21"].state is JobState.SUCCEEDED
    assert statuses["21"].component(0).job_id == SlurmJobId("21")
    assert statuses["22"].state is JobState.PENDING
    assert statuses["22"].component(0).node_list is None  # "None assigned"
    with pytest.raises(KeyError, match="no component"):
        statuses["21"].component(1)


def test_sacct_duplicates_keep_the_latest_incarnation() -> None:
    status = parse_sacct(SACCT_REQUEUED_DUPLICATES)["30"]
    assert len(status.components) == 1 and status.state is JobState.RUNNING
    assert [s.raw_state for s in status.steps] == ["RUNNING", "RUNNING"]


def test_sacct_bad_header() -> None:
    assert parse_sacct("") == {}
    with pytest.raises(ValueError, match="expected --parsable2 columns"):
        parse_sacct("JOBID STATE\n14 RUNNING\n")


def test_squeue() -> None:
    statuses = parse_squeue(SQUEUE_HET)
    assert statuses["14"].state is JobState.RUNNING and statuses["14"].source == "squeue"
    assert [c.node_list for c in statuses["14"].components] == ["n1", "n[2-3]"]
    assert statuses["15"].state is JobState.PENDING
    assert statuses["15"].component(0).reason == "Resources" and statuses["15"].component(0).node_list is None


def test_mixed_component_states() -> None:
    failing = parse_squeue("9+0|FAILED|n1|NonZeroExitCode\n9+1|COMPLETING|n2|None\n")["9"]
    assert failing.state is JobState.RUNNING  # not terminal until every component is
    done = parse_squeue("9+0|FAILED|n1|x\n9+1|CANCELLED|n2|x\n")["9"]
    assert done.state is JobState.FAILED
    assert JobStatus(leader="9", source="none").state is JobState.UNKNOWN


class Runner:
    """Fake command runner: canned stdout per program, or a CalledProcessError like the real one."""

    def __init__(self, outputs: dict[str, str | None]) -> None:
        self.outputs = outputs
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str]) -> str:
        self.calls.append(list(argv))
        out = self.outputs.get(argv[0])
        if out is None:
            raise subprocess.CalledProcessError(1, list(argv), output="", stderr=SACCT_DISABLED)
        return out


def test_query_status_sacct_first() -> None:
    run = Runner({"sacct": SACCT_HET_FAILED, "squeue": SQUEUE_HET})
    status = query_status("14+1", run)
    assert status.source == "sacct" and status.state is JobState.FAILED
    assert run.calls == [sacct_command(["14"])]
    assert run.calls[0] == [
        "sacct",
        "--parsable2",
        "--format=JobID,JobName,State,ExitCode,NodeList",
        "--jobs=14",
    ]


def test_query_status_falls_back_to_squeue() -> None:
    run = Runner({"sacct": None, "squeue": SQUEUE_HET})
    status = query_status("14", run)
    assert status.source == "squeue" and status.state is JobState.RUNNING
    assert run.calls == [sacct_command(["14"]), squeue_command(["14"])]
    # sacct answering without the job (just submitted) also falls back.
    run = Runner({"sacct": "JobID|State\n", "squeue": SQUEUE_HET})
    assert query_status("15", run).state is JobState.PENDING


def test_query_status_unknown_when_nobody_knows() -> None:
    status = query_status("99", Runner({"sacct": None, "squeue": None}))
    assert status == JobStatus(leader="99", source="none") and status.state is JobState.UNKNOWN


@pytest.mark.slurm
def test_sacct_and_squeue_accept_our_columns_on_real_slurm(slurm_cluster) -> None:
    """The recorded texts above are only as good as the columns: the real sacct/squeue must accept them."""
    sacct = slurm_cluster.run(sacct_command(["1"]), check=False)
    assert sacct.returncode == 0, sacct.stderr
    assert sacct.stdout.splitlines()[0].split("|") == ["JobID", "JobName", "State", "ExitCode", "NodeList"]
    squeue = slurm_cluster.run(squeue_command(["1"]), check=False)
    assert "Invalid field" not in squeue.stderr and "Invalid job format" not in squeue.stderr
