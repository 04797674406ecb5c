"""The main job on the real 4-node Slurm cluster (tools/slurm_local, network-namespace mode), as a user submits it:
`mopd-submit configs/slurm_het_cpu.yaml` on micro models → het group 0 (trainer: actor + 2 teachers on one node),
het group 1 (rollout: 2 engines, one per node) → metrics, checkpoints, evaluation; the actor reaches the teachers
and rollout engines by their advertised node names, the rollout engines join the actor's gloo weight-sync group
across nodes, and the job ends COMPLETED when the actor is done (the servers stop on its end-of-job marker).

A second test runs the same job with the teachers in their own het group (configs/slurm_het_teachers_cpu.yaml:
trainer / teacher / rollout, one node, one node, two nodes): the actor scores over the network at the teacher
node's address, no teacher runs on the trainer node, and the three components end COMPLETED.

A third test sends Slurm's checkpoint signal (USR2 to the batch shell, as `--signal=B:USR2@...` does) mid-run:
the actor checkpoints, the job requeues under the same job id, and the rerun resumes, with no lost and no
repeated step (the end-of-job marker of the first run must not stop the rerun's servers). Needs root.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_slurm_jobs import job_gone, job_processes, node_leases, require_netns, stop, wait_for, wait_idle

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "slurm_het_cpu.yaml"
TEACHER_GROUP_CONFIG = REPO / "configs" / "slurm_het_teachers_cpu.yaml"
SUBMIT = Path(sys.executable).with_name("mopd-submit")
ROUTES = ("chain", "legs")
CHILDREN = {("actor", 0), ("teacher", 0), ("teacher", 1), ("rollout", 0), ("rollout", 1)}
# A het job sits PENDING 5-10 s, the children import torch and load models (~15 s on 2 shared cores).
JOB_S = 150
# A requeued job is held for the credential lifetime + 1 s (6 s) and starts at the next node ping (<= 5 s later).
REQUEUE_JOB_S = 240


def submit(cluster, models: Path, run_dir: Path, *overrides: str, config: Path = CONFIG) -> str:
    sets = [
        f"models.actor.path={models / 'student'}",
        f"models.teachers[0].path={models / 'teacher_chain_sum'}",
        f"models.teachers[1].path={models / 'teacher_leg_counting'}",
        "data.batch_size=8",
        "data.eval.size=8",
        *overrides,
    ]
    argv = [str(SUBMIT), str(config), "--run-dir", str(run_dir)]
    for item in sets:
        argv += ["--set", item]
    proc = subprocess.run(
        argv, env=dict(cluster.env), capture_output=True, text=True, timeout=120, cwd=REPO, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    match = re.search(r"submitted job (\d+)", proc.stdout)
    assert match, proc.stdout
    return match[1]


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def sacct_states(cluster, job_id: str) -> dict[str, str]:
    """Het component (`<id>+<n>`) → sacct state, once slurmdbd has recorded the end of every component."""
    proc = cluster.run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "JobID,State"], check=False)
    rows = dict(line.split("|", 1) for line in proc.stdout.splitlines() if "|" in line)
    return rows if rows and all(s not in ("RUNNING", "PENDING", "REQUEUED") for s in rows.values()) else {}


def events(run_dir: Path) -> list[dict]:
    return [
        json.loads(line)
        for path in sorted((run_dir / "events").glob("*.guard.jsonl"))
        for line in path.read_text().splitlines()
    ]


def assert_clean_end(cluster, run_dir: Path, job_id: str, components: int = 2) -> None:
    """Every het component COMPLETED, every child exited 0, no process and no port lease of the job left."""
    states = wait_for(lambda: sacct_states(cluster, job_id), 60, f"sacct to record the end of job {job_id}")
    assert states == {f"{job_id}+{i}": "COMPLETED" for i in range(components)}
    exits = [e for e in events(run_dir) if e["event"] == "exit"]
    assert {(e["role"], e["index"]) for e in exits} == CHILDREN
    assert all(e["exit_code"] == 0 and e["signal"] is None for e in exits), exits
    assert not list((run_dir / "state").glob("first_failure.json"))
    wait_for(lambda: not job_processes(job_id), 10, f"no process of job {job_id} left")
    hosts = {e["host"] for e in events(run_dir)}
    for host in hosts:
        wait_for(
            lambda h=host: not node_leases(cluster, h, job_id), 10, f"no lease of job {job_id} on {host}"
        )
    assert not list((run_dir / "endpoints").glob("*.json"))  # every server removed its endpoint file


def assert_steps(lines: list[dict], steps: int) -> None:
    assert [line["step"] for line in lines] == list(range(1, steps + 1))  # each step exactly once
    for line in lines:
        for key in ("loss/total", "loss/mopd", "mopd/reverse_kl", "train/grad_norm", "perf/tokens_per_s"):
            assert isinstance(line[key], float) and math.isfinite(line[key]), (
                line["step"],
                key,
                line.get(key),
            )
        for route in ROUTES:
            assert 0.0 <= line[f"accuracy/{route}"] <= 1.0 and math.isfinite(line[f"reward/{route}"])
        assert line["loss/rl"] == 0.0 and line["train/response_tokens"] > 0
        assert line["time/rollout_s"] > 0 and line["time/teacher_s"] > 0 and line["time/sync_s"] > 0


def test_three_steps_of_the_het_job_on_micro_models(
    slurm_cluster, micro_models: Path, tmp_path: Path
) -> None:
    require_netns(slurm_cluster)
    wait_idle(slurm_cluster)
    run_dir = tmp_path / "run"
    job_id = submit(slurm_cluster, micro_models, run_dir, "steps=3", "checkpoint_interval=2")
    try:
        wait_for(lambda: job_gone(slurm_cluster, job_id), JOB_S, f"job {job_id} to end")
        lines = metrics(run_dir)
        assert_steps(lines, 3)
        # step s samples with the weights the actor broadcast after step s-1 (version 0: the initial sync)
        assert [line["rollout/weight_version"] for line in lines] == [0.0, 1.0, 2.0]
        assert_eval(run_dir, 8)
        assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
            "latest", "step_000002", "step_000003"]  # fmt: skip
        assert (run_dir / "student_final" / "model.safetensors").is_file()
        end = json.loads((run_dir / "state" / "job_end.json").read_text())
        assert (end["job_id"], end["reason"], end["step"]) == (job_id, "finished", 3)
        # placement: the trainer's children on one node, one rollout engine on each of two other nodes
        spawns = {(e["role"], e["index"]): e["host"] for e in events(run_dir) if e["event"] == "spawn"}
        trainer_host = spawns["actor", 0]
        assert spawns["teacher", 0] == spawns["teacher", 1] == trainer_host
        rollout_hosts = [spawns["rollout", 0], spawns["rollout", 1]]
        assert len(set(rollout_hosts)) == 2 and trainer_host not in rollout_hosts
        # the actor reached every server at its node's own address (the guard's bind, issue 23), not at loopback
        actor_out = (run_dir / "logs" / trainer_host / "actor-0.g1.out").read_text()
        urls = re.findall(r"http://([\w.-]+):\d+", actor_out.split("\n", 1)[0])
        addrs = slurm_cluster.node_addrs
        assert urls == [addrs[h] for h in (*rollout_hosts, trainer_host, trainer_host)], actor_out[:300]
        assert "evaluation at the end" in actor_out and "end/teacher" in actor_out
        # both engines joined the actor's weight-sync group from their nodes and hold the final weights
        for index, host in enumerate(rollout_hosts):
            err = (run_dir / "logs" / host / f"rollout-{index}.g1.err").read_text()
            versions = [int(v) for v in re.findall(r"weight_version=(\d+)", err)]
            assert versions == [0, 1, 2, 3], err[-2000:]
        assert_clean_end(slurm_cluster, run_dir, job_id)
        batch_log = (run_dir / "logs" / f"batch.{job_id}.log").read_text()
        for group in ("0 (trainer)", "1 (rollout)"):
            assert f"step of het group {group} exited with code 0" in batch_log, batch_log
    finally:
        stop(slurm_cluster, job_id)


def assert_eval(run_dir: Path, n: int) -> None:
    """eval.json holds every route's teacher, start and end accuracies over `n` held-out prompts."""
    record = json.loads((run_dir / "eval.json").read_text())
    assert sorted(record["routes"]) == sorted(ROUTES)
    for route in record["routes"].values():
        assert sorted(route) == ["n", "student_end", "student_start", "teacher"] and route["n"] == n
        assert all(0.0 <= route[k] <= 1.0 for k in ("teacher", "student_start", "student_end"))


def test_teachers_in_their_own_het_group(slurm_cluster, micro_models: Path, tmp_path: Path) -> None:
    require_netns(slurm_cluster)
    wait_idle(slurm_cluster)
    run_dir = tmp_path / "run"
    job_id = submit(slurm_cluster, micro_models, run_dir, "steps=2", config=TEACHER_GROUP_CONFIG)
    try:
        wait_for(lambda: job_gone(slurm_cluster, job_id), JOB_S, f"job {job_id} to end")
        assert_steps(metrics(run_dir), 2)
        assert_eval(run_dir, 8)
        # the rank map (run_dir/plan.json) puts the teachers in het group 1 `teacher`, none on a trainer node
        plan = json.loads((run_dir / "plan.json").read_text())
        assert [g["name"] for g in plan["groups"]] == ["trainer", "teacher", "rollout"]
        placed = {(c["role"], c["index"]): (c["het_group"], c["node_index"]) for c in plan["children"]}
        assert placed == {("actor", 0): (0, 0), ("teacher", 0): (1, 0), ("teacher", 1): (1, 0),
                          ("rollout", 0): (2, 0), ("rollout", 1): (2, 1)}  # fmt: skip
        # and so they ran: four nodes, the teachers' one neither the trainer's nor a rollout node
        spawns = {(e["role"], e["index"]): e["host"] for e in events(run_dir) if e["event"] == "spawn"}
        trainer_host, teacher_host = spawns["actor", 0], spawns["teacher", 0]
        rollout_hosts = [spawns["rollout", 0], spawns["rollout", 1]]
        assert spawns["teacher", 1] == teacher_host
        assert len({trainer_host, teacher_host, *rollout_hosts}) == 4
        # the actor scored over the network, at the teacher node's own address
        actor_out = (run_dir / "logs" / trainer_host / "actor-0.g1.out").read_text()
        urls = re.findall(r"http://([\w.-]+):\d+", actor_out.split("\n", 1)[0])
        addrs = slurm_cluster.node_addrs
        assert urls == [addrs[h] for h in (*rollout_hosts, teacher_host, teacher_host)], actor_out[:300]
        assert "evaluation at the end" in actor_out
        assert_clean_end(slurm_cluster, run_dir, job_id, components=3)
        batch_log = (run_dir / "logs" / f"batch.{job_id}.log").read_text()
        for group in ("0 (trainer)", "1 (teacher)", "2 (rollout)"):
            assert f"step of het group {group} exited with code 0" in batch_log, batch_log
    finally:
        stop(slurm_cluster, job_id)


@pytest.mark.slow
def test_checkpoint_signal_requeues_and_the_rerun_resumes(
    slurm_cluster, micro_models: Path, tmp_path: Path
) -> None:
    wait_idle(slurm_cluster)
    run_dir = tmp_path / "run"
    steps = 150  # 0.03-0.05 s each (0.17 on loaded cores): the signal lands mid-run, the rerun takes seconds
    job_id = submit(slurm_cluster, micro_models, run_dir, f"steps={steps}", "checkpoint_interval=50")
    try:
        wait_for(lambda: len(metrics(run_dir)) >= 2, JOB_S, "the first training steps")
        slurm_cluster.run(["scancel", "--batch", "--signal=USR2", job_id])
        first_end = wait_for(
            lambda: (p := run_dir / "state" / "job_end.json").exists() and json.loads(p.read_text()),
            60, "the actor's checkpoint on USR2",
        )  # fmt: skip
        assert (first_end["job_id"], first_end["reason"]) == (job_id, "checkpoint_signal")
        assert 2 <= first_end["step"] < steps
        wait_for(lambda: (run_dir / "state" / "requeue.json").exists(), 60, "the batch shell's requeue")
        end = wait_for(
            lambda: (p := run_dir / "state" / "job_end.json").exists()
            and (r := json.loads(p.read_text()))["reason"] == "finished" and r,
            REQUEUE_JOB_S, "the requeued job to finish training",
        )  # fmt: skip
        assert (end["job_id"], end["step"]) == (job_id, steps)
        wait_for(lambda: job_gone(slurm_cluster, job_id), 60, f"job {job_id} to end")
        assert_steps(metrics(run_dir), steps)  # none lost, none repeated across the requeue
        assert json.loads((run_dir / "state" / "job.json").read_text())["restart_count"] == 1
        actor_err = "".join(p.read_text() for p in (run_dir / "logs").glob("*/actor-0.g*.err"))
        assert (
            f"resumed from {run_dir / 'checkpoints' / 'step_{:06d}'.format(first_end['step'])}" in actor_err
        )
        states = wait_for(lambda: sacct_states(slurm_cluster, job_id), 60, f"sacct to record job {job_id}")
        assert states == {f"{job_id}+0": "COMPLETED", f"{job_id}+1": "COMPLETED"}
        wait_for(lambda: not job_processes(job_id), 10, f"no process of job {job_id} left")
    finally:
        stop(slurm_cluster, job_id)
