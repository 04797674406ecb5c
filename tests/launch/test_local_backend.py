"""The local backend end to end: `mopd-submit --local` as a real subprocess, one real guard, real probe
children, real port leases. Probe-only runs (the trainer roles land later)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers_wait import until

from mopd_hpc.runtime.ports_registry import list_node_leases

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
#: How long a poll waits for the job's children (a loaded machine with parallel test workers starts them slowly).
DEADLINE_S = 120
#: The probes hold this long unless stopped: a job that ends well before it was ended, not waited for.
HOLD_S = 300


def env_for(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MOPD_"))}
    return {**env, **extra}


def start(config: str, run_dir: Path, **extra: str) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "mopd_hpc.cli.submit", str(CONFIGS / config), "--local", "--probe"]
    argv += ["--run-dir", str(run_dir)]
    return subprocess.Popen(argv, cwd=REPO, env=env_for(**extra), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def reports(run_dir: Path) -> list[dict]:
    out = []
    for path in sorted((run_dir / "probe").glob("*.json")):
        out.append(json.loads(path.read_text()))
    return sorted(out, key=lambda r: r["index"])


def processes_of(run_dir: Path) -> list[int]:
    """Live processes whose environment (children: MOPD_RUN_DIR) or argv (the guard: --run-dir) names the run."""
    needle, arg = f"MOPD_RUN_DIR={run_dir}\0".encode(), f"\0{run_dir}\0".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = b"\0" + Path(f"/proc/{entry}/cmdline").read_bytes()
            if needle in Path(f"/proc/{entry}/environ").read_bytes() or arg in cmdline:
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def leases_of(job_id: str) -> list:
    return [lease for lease in list_node_leases() if lease.job_id == job_id]


def test_probe_only_local_run_reports_every_child(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start("slurm_het_cpu.yaml", run_dir)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err + out
    got = reports(run_dir)
    plan = json.loads((run_dir / "plan.json").read_text())
    assert [(r["plan_role"], r["plan_index"]) for r in got] == [
        ("actor", 0), ("teacher", 0), ("teacher", 1), ("rollout", 0), ("rollout", 1)]  # fmt: skip
    for report, child in zip(got, plan["children"], strict=True):
        topo = report["topology"]
        assert report["role"] == "probe" and report["index"] == child["index"]
        assert (topo["backend"], topo["het_group"], topo["het_size"]) == ("local", child["het_group"], 2)
        assert (topo["rank"], topo["world_size"]) == (
            int(child["env"]["MOPD_RANK"]),
            int(child["env"]["MOPD_WORLD_SIZE"]),
        )
        assert sorted(report["ports"]) == sorted(child["port_names"])
        assert report["transfer_ranks"] == child["transfer_ranks"] and report["restart_count"] == 0
        assert report["resume_checkpoint"] is None and report["env"]["MOPD_BACKEND"] == "local"
        assert report["weight_sync_backend"] == "torch"  # the probe table numbers as the dry-run
    assert [r["topology"]["rank"] for r in got if r["plan_role"] == "rollout"] == [0, 1]
    ports = [p for r in got for p in r["ports"].values()]
    assert (
        len(ports) == len(set(ports)) == 2 + 2 + 2 * 3
    )  # no port leased twice on this host (actor: master, nccl)
    assert "what the 5 probe(s) reported" in out and "[local] done: exit code 0" in out
    assert processes_of(run_dir) == []


def test_ctrl_c_leaves_no_orphan_and_no_lease(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start("local_cpu.yaml", run_dir, MOPD_PROBE_HOLD_S="300")
    try:
        assert until(lambda: len(list((run_dir / "probe").glob("*.json"))) == 4, DEADLINE_S), proc.stderr
        job_id = f"local-{proc.pid}"
        assert (
            len(leases_of(job_id)) == 1 + 2 + 2 + 3
        )  # the guard's http + master, nccl + 2·http + rollout's 3
        assert len(set(processes_of(run_dir)) - {proc.pid}) == 5  # the guard and 4 probes
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, err + out
    assert "guard got SIGINT: stopping" in out
    assert until(lambda: processes_of(run_dir) == [], 10), processes_of(run_dir)
    assert leases_of(job_id) == []


def test_a_failing_child_ends_the_local_job_with_its_code(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    proc = start("slurm_het_cpu.yaml", run_dir, MOPD_PROBE_HOLD_S=str(HOLD_S), MOPD_PROBE_EXIT_CODE="3",
                 MOPD_PROBE_EXIT_HET_GROUP="1")  # fmt: skip
    out, err = proc.communicate(timeout=HOLD_S / 2)
    assert proc.returncode == 3, err + out
    assert time.monotonic() - t0 < HOLD_S / 2  # the holding probes were killed, not waited for
    assert "FAILED: probe[3] (rollout[0])" in out or "FAILED: probe[4] (rollout[1])" in out
    events = [
        json.loads(line) for p in (run_dir / "events").glob("*.jsonl") for line in p.read_text().splitlines()
    ]
    failed = [e for e in events if e["event"] == "plan_failed"]
    assert len(failed) == 1 and failed[0]["code"] == 3 and failed[0]["index"] in (3, 4)
    assert processes_of(run_dir) == []
