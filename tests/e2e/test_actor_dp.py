"""The actor group at DP = 2 end to end on the local backend: `mopd-submit configs/local_cpu_dp2.yaml --local`
(two actor children of one gloo world, one teacher child per teacher, one rollout engine) on micro models.

- DP = 2 vs the same config at DP = 1 (actor_ranks_per_node 1), 6 steps, the same seed and global batch:
  every step's globally reduced loss within 1e-5 relative, and the final weights (student_final) with every
  |Δw| ≤ 2·lr·steps and ≥ 99.9 % of the elements within 1e-6; the DP = 1 run is conftest's `plain_run`
  (configs/local_cpu_dp2.yaml at one actor rank is configs/local_cpu.yaml but for its name: asserted);
- SIGKILL of actor rank 1 mid-run: the job ends within 60 s, no process and no port lease of the job is left
  (`mopd-debug ports`), `mopd-logs summarize` names rank 1 first (rank 0's lost peer is its cascade); the
  DP = 2 checkpoint then resumes at DP = 2 with every step exactly once, and a copy of the run resumes at
  DP = 1 (the replicated DDP state is every rank's: nothing to reshard) to the same weights.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers_configs import set_dotted
from helpers_jobs import PLAIN_STEPS, PlainRun, submit_local
from helpers_wait import until
from safetensors.torch import load_file
from test_local_backend import processes_of

from mopd_hpc.logs.summary import no_sacct, summarize_run
from mopd_hpc.records.run_dir import LATEST_CHECKPOINT

REPO = Path(__file__).resolve().parents[2]
DP2 = REPO / "configs" / "local_cpu_dp2.yaml"
#: What the SIGKILL test's job may take to end after the kill, seconds (the issue's bound).
END_AFTER_KILL_S = 60


def dp_config(models: Path, run_dir: Path, path: Path, ranks: int, **changes: object) -> Path:
    """configs/local_cpu_dp2.yaml on the micro models, small, eval off, `ranks` actor ranks on the node."""
    doc = yaml.safe_load(DP2.read_text())
    doc["run_dir"] = str(run_dir)
    doc["models"]["actor"]["path"] = doc["models"]["tokenizer"]["path"] = str(models / "student")
    for teacher, name in zip(
        doc["models"]["teachers"], ("teacher_chain_sum", "teacher_leg_counting"), strict=True
    ):
        teacher["path"] = str(models / name)
    doc.update(steps=3, checkpoint_interval=2)
    set_dotted(doc, {"data.batch_size": 8, "data.eval.size": 0, "cluster.group.actor_ranks_per_node": ranks})
    set_dotted(doc, changes)
    path.write_text(yaml.safe_dump(doc))
    return path


def env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("MOPD_", "SLURM_", "GLOO_"))}


def submit(config: Path, *args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    return submit_local(config, *args, cwd=REPO, timeout_s=timeout, env=env())


def metric_lines(run_dir: Path) -> list[dict]:
    """Every line of metrics.jsonl as written (no de-duplication: a repeated step shows twice)."""
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "student_final" / "model.safetensors")


def assert_close_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], bound: float) -> float:
    """Every |Δw| ≤ bound and ≥ 99.9 % of the elements within 1e-6; returns the largest |Δw|."""
    assert a.keys() == b.keys()
    worst, close, total = 0.0, 0, 0
    for name in a:
        diff = (a[name].double() - b[name].double()).abs()
        worst = max(worst, float(diff.max()))
        close += int((diff <= 1e-6).sum())
        total += diff.numel()
    assert worst <= bound, (worst, bound)
    assert close / total >= 0.999, close / total
    return worst


def test_dp2_computes_the_dp1_update(micro_models: Path, plain_run: PlainRun, tmp_path: Path) -> None:
    runs = {1: plain_run.run_dir, 2: tmp_path / "dp2"}
    changes = {"steps": PLAIN_STEPS, "checkpoint_interval": 1, "data.eval.size": 1}  # plain_run's
    proc = submit(dp_config(micro_models, runs[2], tmp_path / "dp2.yaml", 2, **changes))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for ranks, out in ((1, plain_run.stdout), (2, proc.stdout)):
        assert f"world {ranks} = dp {ranks} × tp 1 × pp 1" in out
    resolved = {r: yaml.safe_load((runs[r] / "config.yaml").read_text()) for r in runs}
    for doc in resolved.values():
        del doc["name"], doc["run_dir"], doc["cluster"]["group"]["actor_ranks_per_node"]
    assert resolved[1] == resolved[2]  # the same run but for the actor's ranks
    one, two = metric_lines(runs[1]), metric_lines(runs[2])
    assert [x["step"] for x in one] == [x["step"] for x in two] == list(range(1, PLAIN_STEPS + 1))
    for a, b in zip(one, two, strict=True):
        assert b["loss/total"] == pytest.approx(a["loss/total"], rel=1e-5)
        assert b["train/response_tokens"] == a["train/response_tokens"]  # the same global batch
        assert b["mopd/rho_mean"] == pytest.approx(a["mopd/rho_mean"], rel=1e-5)
    lr = yaml.safe_load(DP2.read_text())["models"]["actor"]["optimizer"]["lr"]
    assert_close_weights(weights(runs[1]), weights(runs[2]), 2 * lr * PLAIN_STEPS)
    exits = [json.loads(x) for f in (runs[2] / "events").glob("*.jsonl") for x in f.read_text().splitlines()]
    exits = {(e["role"], e["index"]): e["exit_code"] for e in exits if e.get("event") == "exit"}
    assert exits == {
        ("actor", 0): 0,
        ("actor", 1): 0,
        ("teacher", 0): 0,
        ("teacher", 1): 0,
        ("rollout", 0): 0,
    }


def child_pid(run_dir: Path, role: str, index: int) -> int | None:
    for path in (run_dir / "ports").glob("*.json"):
        for child in json.loads(path.read_text())["children"]:
            if (child["role"], child["index"]) == (role, index):
                return int(child["pid"])
    return None


def job_leases(job_id: str) -> list[dict]:
    argv = [sys.executable, "-m", "mopd_hpc.cli.debug", "ports", "--json"]
    proc = subprocess.run(argv, env=env(), capture_output=True, text=True, timeout=60, check=True)
    return [x for x in json.loads(proc.stdout) if x.get("job_id") == job_id]


def test_sigkill_of_rank1_ends_the_job_and_the_dp2_checkpoint_resumes(
    micro_models: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    config = dp_config(micro_models, run_dir, tmp_path / "dp2.yaml", 2, steps=6)
    argv = [sys.executable, "-m", "mopd_hpc.cli.submit", str(config), "--local"]
    proc = subprocess.Popen(
        argv, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        metrics = run_dir / "metrics.jsonl"
        assert until(lambda: metrics.exists() and len(metric_lines(metrics.parent)) >= 3, 300)
        pid = child_pid(run_dir, "actor", 1)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        out, _ = proc.communicate(timeout=END_AFTER_KILL_S + 30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert time.monotonic() - killed < END_AFTER_KILL_S, out[-2000:]
    assert proc.returncode == 128 + signal.SIGKILL, out[-3000:]
    job_id = re.search(r"\[local\] job (local-\d+)", out)[1]
    assert until(lambda: processes_of(run_dir) == [], 10), processes_of(run_dir)
    assert job_leases(job_id) == []
    first = summarize_run(run_dir, sacct_runner=no_sacct).first_failure
    assert (first.role, first.index, first.cause.key) == ("actor", 1, "killed_by_signal")
    assert all(
        label.endswith(("actor-0", "teacher-0", "teacher-1", "rollout-0")) for label, _ in first.cascade
    )
    done = [x["step"] for x in metric_lines(run_dir)]
    assert done[:3] == [1, 2, 3] and (run_dir / "checkpoints" / "step_000002").is_dir()

    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy, symlinks=True)
    # the kill lands after step 3's metrics line; a fast machine may have committed step 4's checkpoint before
    # it does. A resume starts from the one `latest` names: a loaded machine may have published step_000004's
    # directory and been killed before `latest` named it (trainer/checkpoint.py: never committed)
    newest = (run_dir / LATEST_CHECKPOINT).read_text().strip()
    assert newest in ("step_000002", "step_000004"), newest
    published = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert published[-1] in (newest, "step_000004"), published
    resumed = submit(config, "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"from checkpoints/{newest}" in resumed.stdout
    assert [x["step"] for x in metric_lines(run_dir)] == [1, 2, 3, 4, 5, 6]  # every step exactly once

    at_dp1 = submit(config, "--resume", str(copy), "--set", "cluster.group.actor_ranks_per_node=1")
    assert at_dp1.returncode == 0, at_dp1.stdout[-3000:] + at_dp1.stderr[-3000:]
    said = "".join(p.read_text() for p in (copy / "logs").glob("*/actor-0.g*.out"))
    assert "saved by an actor world of 2 ranks, resumed on 1" in said
    assert [x["step"] for x in metric_lines(copy)] == [1, 2, 3, 4, 5, 6]
    lr = yaml.safe_load(DP2.read_text())["models"]["actor"]["optimizer"]["lr"]
    assert_close_weights(weights(run_dir), weights(copy), 2 * lr * 6)
