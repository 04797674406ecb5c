"""sacct parsing on text recorded from the local Slurm 22.05 cluster (tests/data/logs/README.md)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from mopd_hpc.logs.sacct import SACCT_FIELDS, parse_sacct_jobs, query_sacct, sacct_command

SACCT = Path(__file__).resolve().parents[1] / "data" / "logs" / "sacct"


def test_het_job_components_are_folded_under_the_leader() -> None:
    jobs = parse_sacct_jobs((SACCT / "sacct_het_failed.txt").read_text())
    assert list(jobs) == ["51"]
    job = jobs["51"]
    assert [c.component_id for c in job.components] == ["51+0", "51+1"]
    c0, c1 = job.components
    assert (c0.state, c0.coarse_state, c0.exit_code, c0.node_list) == ("FAILED", "FAILED", "3:0", "n1")
    assert (c1.node_list, c1.alloc_tres) == ("n[2-3]", "billing=2,cpu=2,gres/gpu=2,mem=1000M,node=2")
    assert [s.step_id for s in c0.steps] == ["51+0.batch", "51+0.1"]
    assert c0.steps[1].state == "CANCELLED" and c1.steps[0].exit_code == "3:0"
    assert job.requeues == 0


def test_timeout_and_requeued_incarnations() -> None:
    jobs = parse_sacct_jobs((SACCT / "sacct_all.txt").read_text())
    assert sorted(jobs) == ["51", "53", "54"]
    (to,) = jobs["53"].components
    assert (to.state, to.elapsed, to.time_limit) == ("TIMEOUT", "00:01:17", "00:01:00")
    (rq,) = jobs["54"].components
    assert (rq.incarnations, rq.state, rq.coarse_state, rq.reason) == (
        2,
        "CANCELLED by 0",
        "CANCELLED",
        "BeginTime",
    )
    assert jobs["54"].requeues == 1
    assert [s.step_id for s in rq.steps] == ["54.batch", "54.0"] and rq.start == "2026-11-29T21:20:28"


def test_command_and_failing_runner() -> None:
    argv = sacct_command("51+1.0")
    assert argv[:3] == ["sacct", "--parsable2", "--duplicates"] and argv[-1] == "--jobs=51"
    assert argv[3] == "--format=" + ",".join(SACCT_FIELDS) and "Restarts" not in SACCT_FIELDS

    def disabled(argv):
        raise subprocess.CalledProcessError(1, argv, stderr="Slurm accounting storage is disabled")

    assert query_sacct("51", disabled) is None
    assert query_sacct("51", lambda argv: "garbage without header\n") is None
    assert query_sacct("52", lambda argv: (SACCT / "sacct_all.txt").read_text()) is None
    assert query_sacct("51+1", lambda argv: (SACCT / "sacct_all.txt").read_text()).leader == "51"
