"""`mopd-submit` on the real 4-node cluster (tools/slurm_local, network-namespace mode), probe-only jobs from
configs/slurm_het_cpu.yaml: a het job's ranks and leases, scancel cleanup, requeue with resume, submission from
inside an allocation, and a failing component ending the job. Polls with deadlines; needs root."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers_wait import wait_for

from mopd_hpc.runtime.hostlist import expand_hostlist

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "slurm_het_cpu.yaml"
SUBMIT = Path(sys.executable).with_name("mopd-submit")
PROBES = 5  # actor, 2 teachers on the trainer node; 2 rollout engines on the rollout nodes
START_S = 60  # het jobs sit PENDING 5-10 s before starting (slurm-local-findings.md §4)


def wait_idle(cluster) -> None:
    def idle() -> bool:
        out = cluster.run(["sinfo", "-h", "-N", "-o", "%N %T"]).stdout
        return all(line.split()[1] == "idle" for line in out.splitlines() if line.strip())

    wait_for(idle, 180, "idle nodes")


def submit(cluster, run_dir: Path, *, prefix: tuple[str, ...] = (), **knobs: str) -> str:
    env = {**cluster.env, **knobs}
    proc = subprocess.run(
        [*prefix, str(SUBMIT), str(CONFIG), "--probe", "--run-dir", str(run_dir)],
        env=env, capture_output=True, text=True, timeout=120, cwd=REPO, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    match = re.search(r"submitted job (\d+)", proc.stdout)
    assert match, proc.stdout
    assert f"mopd-logs summarize {match[1]}" in proc.stdout
    return match[1]


def reports(run_dir: Path) -> list[dict]:
    out = []
    for path in (run_dir / "probe").glob("*.json"):
        try:
            out.append(json.loads(path.read_text()))
        except ValueError:
            continue
    return sorted(out, key=lambda r: r["index"])


def job_gone(cluster, job_id: str) -> bool:
    proc = cluster.run(["squeue", "-h", "-j", job_id, "-o", "%T"], check=False)
    return proc.returncode != 0 or not proc.stdout.strip()


def job_processes(job_id: str) -> list[int]:
    """Live (non-zombie) processes of the job on this host: every node shares its pid namespace."""
    needle = f"SLURM_JOB_ID={job_id}\0".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if needle in Path(f"/proc/{entry}/environ").read_bytes():
                if Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def node_leases(cluster, node: str, job_id: str) -> list[dict]:
    """The port leases of `job_id` on `node`: abstract sockets live per network namespace, so look inside it."""
    code = (
        "import json; from mopd_hpc.runtime.ports_registry import list_node_leases; "
        "print(json.dumps([x.to_dict() for x in list_node_leases()]))"
    )
    proc = cluster.run(["nsenter", f"--net=/run/netns/slurm-{node}", sys.executable, "-c", code])
    return [x for x in json.loads(proc.stdout) if x["job_id"] == job_id]


def require_netns(cluster) -> None:
    if cluster.mode != "netns":
        pytest.skip(
            f"needs the network-namespace mode of tools/slurm_local; the cluster is in {cluster.mode!r}"
        )


def stop(cluster, job_id: str) -> None:
    cluster.run(["scancel", job_id], check=False)
    wait_for(lambda: job_gone(cluster, job_id), 60, f"job {job_id} to end")


def test_het_probe_job_ranks_and_leases_then_scancel_cleans_up(slurm_cluster, tmp_path: Path) -> None:
    require_netns(slurm_cluster)
    wait_idle(slurm_cluster)
    run_dir = tmp_path / "run"
    job_id = submit(slurm_cluster, run_dir, MOPD_PROBE_HOLD_S="300")
    try:
        got = wait_for(
            lambda: len(reports(run_dir)) == PROBES and reports(run_dir), START_S, "5 probe reports"
        )
        by_role = {(r["plan_role"], r["plan_index"]): r for r in got}
        trainer = [r for r in got if r["topology"]["het_group"] == 0]
        rollout = [r for r in got if r["topology"]["het_group"] == 1]
        assert {r["host"] for r in trainer} == {"n1"}
        assert sorted(r["host"] for r in rollout) == ["n2", "n3"]
        for r in got:
            topo = r["topology"]
            assert (topo["backend"], topo["job_id"], topo["het_size"]) == ("slurm", job_id, 2)
            assert topo["hostname"] == r["host"] and r["restart_count"] == 0
        assert [by_role["rollout", i]["topology"]["group_hosts"] for i in (0, 1)] == [["n2", "n3"]] * 2
        assert [(by_role["rollout", i]["host"], by_role["rollout", i]["topology"]["node_index"]) for i in (0, 1)] == [
            ("n2", 0), ("n3", 1)]  # fmt: skip
        assert [(by_role["rollout", i]["topology"]["rank"], by_role["rollout", i]["topology"]["world_size"])
                for i in (0, 1)] == [(0, 2), (1, 2)]  # fmt: skip
        assert by_role["actor", 0]["topology"]["group_hosts"] == ["n1"]
        assert sorted(t for r in got for t in r["transfer_ranks"]) == [0, 1, 2]  # dense, unique
        assert by_role["actor", 0]["transfer_ranks"] == [2]
        for host in ("n1", "n2", "n3"):
            ports = [p for r in got if r["host"] == host for p in r["ports"].values()]
            assert len(ports) == len(set(ports)), f"a port leased twice on {host}: {ports}"
            leased = node_leases(slurm_cluster, host, job_id)
            assert sorted(x["port"] for x in leased if x["role"] == "probe") == sorted(ports)
            assert len({x["port"] for x in leased}) == len(leased)
        guard = json.loads((run_dir / "guards" / "n2.json").read_text())
        assert guard["bind"] == slurm_cluster.node_addrs["n2"]  # reachable from the other nodes
        slurm_cluster.run(["scancel", job_id])
        t0 = time.monotonic()
        wait_for(lambda: not job_processes(job_id), 10, f"no process of job {job_id} left")
        for host in ("n1", "n2", "n3"):
            wait_for(lambda h=host: not node_leases(slurm_cluster, h, job_id), 10 - (time.monotonic() - t0),
                     f"no lease of job {job_id} on {host}")  # fmt: skip
        assert time.monotonic() - t0 < 10
    finally:
        stop(slurm_cluster, job_id)


def test_requeue_resumes_from_the_checkpoint(slurm_cluster, tmp_path: Path) -> None:
    wait_idle(slurm_cluster)
    run_dir = tmp_path / "run"
    job_id = submit(slurm_cluster, run_dir, MOPD_PROBE_HOLD_S="300")
    try:
        wait_for(lambda: len(reports(run_dir)) == PROBES, START_S, "5 probe reports")
        (run_dir / "checkpoints").mkdir()
        (run_dir / "checkpoints" / "latest").write_text("step_000050\n")
        slurm_cluster.run(["scontrol", "requeue", job_id])
        # rerun delay = the batch shell's end + cred_expire (5 s) + 1 s + the next node ping (<= 5 s)
        got = wait_for(
            lambda: (r := reports(run_dir)) and len(r) == PROBES and all(x["restart_count"] == 1 for x in r) and r,
            120, "the requeued job's probes",
        )  # fmt: skip
        assert {r["resume_checkpoint"] for r in got} == {"step_000050"}
        assert {r["topology"]["job_id"] for r in got} == {job_id}
        assert json.loads((run_dir / "state" / "job.json").read_text())["restart_count"] == 1
    finally:
        stop(slurm_cluster, job_id)


def test_submission_from_inside_an_allocation_passes_no_inherited_variable(
    slurm_cluster, tmp_path: Path
) -> None:
    wait_idle(slurm_cluster)
    run_dir = tmp_path / "run"
    keys = "SLURM_TEST_INHERITED,SBATCH_TEST_INHERITED,PMIX_TEST_INHERITED,SLURM_CPU_BIND,SLURM_JOB_NODELIST"
    marker = tmp_path / "outer.env"
    prefix = ("salloc", "-N1", "-w", "n4", "--time=2", "bash", "-c", f'env > "{marker}"; exec "$@"', "_")
    job_id = submit(
        slurm_cluster, run_dir, prefix=prefix, SLURM_TEST_INHERITED="outer", SBATCH_TEST_INHERITED="outer",
        PMIX_TEST_INHERITED="outer", SLURM_CPU_BIND="verbose,map_cpu:1", MOPD_PROBE_ENV_KEYS=keys,
        MOPD_PROBE_HOLD_S="300",  # else a rollout probe that ends first tears the job down before n1's write
    )  # fmt: skip
    try:
        outer = dict(line.split("=", 1) for line in marker.read_text().splitlines() if "=" in line)
        assert (
            outer["SLURM_TEST_INHERITED"] == "outer" and outer["SLURM_JOB_ID"] != job_id
        )  # really inside one
        got = wait_for(
            lambda: len(reports(run_dir)) == PROBES and reports(run_dir), START_S, "5 probe reports"
        )
        for r in got:
            env = r["env"]
            for key in (
                "SLURM_TEST_INHERITED",
                "SBATCH_TEST_INHERITED",
                "PMIX_TEST_INHERITED",
                "SLURM_CPU_BIND",
            ):
                assert key not in env, f"{key} reached the new job on {r['host']}"
            # the job's own node list, not the allocation's (n4, which the new job may get once salloc ends)
            assert expand_hostlist(env["SLURM_JOB_NODELIST"]) == r["topology"]["group_hosts"]
            assert r["topology"]["job_id"] == job_id
    finally:
        stop(slurm_cluster, job_id)


def test_a_failing_component_ends_the_whole_job(slurm_cluster, tmp_path: Path) -> None:
    wait_idle(slurm_cluster)
    run_dir = tmp_path / "run"
    job_id = submit(
        slurm_cluster,
        run_dir,
        MOPD_PROBE_HOLD_S="300",
        MOPD_PROBE_EXIT_CODE="3",
        MOPD_PROBE_EXIT_HET_GROUP="1",
    )
    try:
        # the first rollout probe reports, then exits 3; the other may be stopped before it reports
        failed = wait_for(
            lambda: sorted((run_dir / "probe").glob("n[23]-*.json")), START_S, "a rollout report"
        )
        failed_at = failed[0].stat().st_mtime
        wait_for(
            lambda: job_gone(slurm_cluster, job_id), 30, f"job {job_id} to end after its rollout step failed"
        )
        assert time.time() - failed_at < 30
        first = json.loads((run_dir / "state" / "first_failure.json").read_text())
        assert (first["component"], first["het_group"], first["job_id"]) == ("rollout", 1, job_id)
        # srun reports the step's highest task code, so the batch shell may see a node stopped by
        # --kill-on-bad-exit; the failing node's guard names the probe's own code in its events
        assert first["exit_code"] != 0
        events = [
            json.loads(x)
            for p in (run_dir / "events").glob("n[23].guard.jsonl")
            for x in p.read_text().splitlines()
        ]
        assert {e["code"] for e in events if e["event"] == "plan_failed"} == {3}
        wait_for(lambda: not job_processes(job_id), 10, f"no process of job {job_id} left")
    finally:
        stop(slurm_cluster, job_id)


def test_preemption_signal_to_the_batch_shell_checkpoints_steps_and_requeues(
    slurm_cluster, tmp_path: Path
) -> None:
    """`--signal=B:USR2@...` as Slurm delivers it: USR2 to the batch shell and its children (`scancel --batch`).

    The batch shell must forward USR2 to the steps (the guards), not lose its own background sruns to it,
    then requeue; the requeued job comes back with SLURM_RESTART_COUNT=1 (issue 5, item 4)."""
    wait_idle(slurm_cluster)
    run_dir = tmp_path / "run"
    job_id = submit(slurm_cluster, run_dir, MOPD_PROBE_HOLD_S="300")
    try:
        wait_for(lambda: len(reports(run_dir)) == PROBES, START_S, "5 probe reports")
        slurm_cluster.run(["scancel", "--batch", "--signal=USR2", job_id])
        signal = wait_for(
            lambda: (p := run_dir / "state" / "last_signal.json").exists() and json.loads(p.read_text()),
            30, "the batch shell's signal record",
        )  # fmt: skip
        assert signal["signal"] == "USR2" and signal["restart_count"] == 0
        # every guard (one per node) got the forwarded USR2 through its step, and none died of it first
        events = [
            json.loads(line)
            for path in (run_dir / "events").glob("*.guard.jsonl")
            for line in path.read_text().splitlines()
        ]
        wait_for(
            lambda: {
                json.loads(line)["host"]
                for path in (run_dir / "events").glob("*.guard.jsonl")
                for line in path.read_text().splitlines()
                if json.loads(line)["event"] == "guard_signal"
            } == {"n1", "n2", "n3"},
            30, "USR2 forwarded to the guards on n1, n2, n3",
        )  # fmt: skip
        assert all(e.get("signal") != "SIGKILL" for e in events if e["event"] == "exit")
        got = wait_for(
            lambda: (r := reports(run_dir)) and len(r) == PROBES and all(x["restart_count"] == 1 for x in r) and r,
            120, "the requeued job's probes",
        )  # fmt: skip
        assert {r["topology"]["job_id"] for r in got} == {job_id}
    finally:
        stop(slurm_cluster, job_id)
