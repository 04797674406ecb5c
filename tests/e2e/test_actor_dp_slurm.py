"""The actor group across two trainer nodes of the real 4-node Slurm cluster (tools/slurm_local, network-namespace
mode): `mopd-submit configs/slurm_het_cpu_dp2.yaml` on micro models → het group 0 (trainer: actor rank 0 and both
teachers on node 0, actor rank 1 on node 1), het group 1 (rollout: one engine per node). Rank 1 finds rank 0's
rendezvous record in the shared run directory and joins its gloo world across the nodes (DP = 2); the job
COMPLETES with its evaluation written, every step once, and leaves no process, lease or endpoint record.
Needs root (the cluster); marked `slurm`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_main_job_slurm import SUBMIT, assert_steps, events, metrics, sacct_states
from test_slurm_jobs import job_gone, job_processes, node_leases, require_netns, stop, wait_for, wait_idle

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "slurm_het_cpu_dp2.yaml"
ROUTES = ("chain", "legs")
CHILDREN = {("actor", 0), ("actor", 1), ("teacher", 0), ("teacher", 1), ("rollout", 0), ("rollout", 1)}
# A het job sits PENDING 5-10 s; six children import torch and load models on 2 shared cores.
JOB_S = 240


def submit(cluster, models: Path, run_dir: Path, *overrides: str) -> str:
    import subprocess

    sets = [
        f"models.actor.path={models / 'student'}",
        f"models.teachers[0].path={models / 'teacher_chain_sum'}",
        f"models.teachers[1].path={models / 'teacher_leg_counting'}",
        "data.batch_size=8",
        "data.eval.size=8",
        *overrides,
    ]
    argv = [str(SUBMIT), str(CONFIG), "--run-dir", str(run_dir)]
    for item in sets:
        argv += ["--set", item]
    proc = subprocess.run(
        argv, env=dict(cluster.env), capture_output=True, text=True, timeout=120, cwd=REPO, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "actor: world 2 = dp 2 × tp 1 × pp 1" in proc.stdout, proc.stdout
    match = re.search(r"submitted job (\d+)", proc.stdout)
    assert match, proc.stdout
    return match[1]


def test_dp2_on_two_trainer_nodes_completes_with_its_evaluation(
    slurm_cluster, micro_models: Path, tmp_path: Path
) -> None:
    require_netns(slurm_cluster)
    wait_idle(slurm_cluster)
    run_dir = tmp_path / "run"
    job_id = submit(slurm_cluster, micro_models, run_dir, "steps=3", "checkpoint_interval=2")
    try:
        wait_for(lambda: job_gone(slurm_cluster, job_id), JOB_S, f"job {job_id} to end")
        states = wait_for(lambda: sacct_states(slurm_cluster, job_id), 60, f"sacct to record job {job_id}")
        assert states == {f"{job_id}+0": "COMPLETED", f"{job_id}+1": "COMPLETED"}
        assert_steps(metrics(run_dir), 3)
        record = json.loads((run_dir / "eval.json").read_text())
        assert sorted(record["routes"]) == sorted(ROUTES)
        for route in record["routes"].values():
            assert sorted(route) == ["n", "student_end", "student_start", "teacher"] and route["n"] == 8
        assert (run_dir / "student_final" / "model.safetensors").is_file()
        end = json.loads((run_dir / "state" / "job_end.json").read_text())
        assert (end["job_id"], end["reason"], end["step"]) == (job_id, "finished", 3)
        # the two actor ranks on the two trainer nodes, rank 1 joined rank 0's world across them
        spawns = {(e["role"], e["index"]): e["host"] for e in events(run_dir) if e["event"] == "spawn"}
        assert spawns["actor", 0] != spawns["actor", 1]
        assert spawns["teacher", 0] == spawns["teacher", 1] == spawns["actor", 0]
        rank1_err = (run_dir / "logs" / spawns["actor", 1] / "actor-1.g1.err").read_text()
        joined = re.search(
            r"actor group: rank 1/2 \(dp 1/2, tp 0/1, gloo on cpu\), store ([\w.-]+):\d+", rank1_err
        )
        assert joined, rank1_err[-2000:]
        assert joined[1] not in ("127.0.0.1", "localhost")  # rank 0's node address, not loopback
        assert "finished at step 3" in rank1_err
        exits = [e for e in events(run_dir) if e["event"] == "exit"]
        assert {(e["role"], e["index"]) for e in exits} == CHILDREN
        assert all(e["exit_code"] == 0 and e["signal"] is None for e in exits), exits
        wait_for(lambda: not job_processes(job_id), 10, f"no process of job {job_id} left")
        for host in {e["host"] for e in events(run_dir)}:
            wait_for(lambda h=host: not node_leases(slurm_cluster, h, job_id), 10, f"no lease on {host}")
        assert not list((run_dir / "endpoints").glob("*.json"))  # the rendezvous record went with rank 0
    finally:
        stop(slurm_cluster, job_id)
