"""The KL penalty end to end on the local backend: `mopd-submit configs/local_cpu.yaml --local --set
loss.rl_coefficient=1 --set loss.kl_coefficient=0.5` (micro models, few steps), stopped with SIGUSR2 after a
step and resumed, and the same at DP = 2 (configs/local_cpu_dp2.yaml) against DP = 1.

What proves the reference is the STARTING actor after the resume: the k3 KL of the metrics (`ref/kl`) is
exactly 0 at step 1 (π_θ = π_ref, the same weights, the same forward) and > 0 at the first step after the
resume; a reference loaded from the checkpoint would make that step's KL exactly 0 again. And the actor's log
names models.actor.path as the reference's source in both runs.

The stopped and resumed run is the DP = 1 run the DP = 2 run is compared with (configs/local_cpu_dp2.yaml at one
actor rank is configs/local_cpu.yaml): the module fixture `kl_runs` runs three jobs, not four (a job costs ~30
CPU-s, nearly all of it its children's imports); a resume computes the uninterrupted run bitwise
(tests/faults/test_fault_kill_resume.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_actor_dp import dp_config
from test_resume import actor_pid, latest_step, wait_for_lines

from mopd_hpc.records.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
STEPS = 5
KL_SETS = ("--set", "loss.rl_coefficient=1.0", "--set", "loss.kl_coefficient=0.5")


def argv(config: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "mopd_hpc.cli.submit", str(config), "--local", *KL_SETS, *extra]


def env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("MOPD_", "SLURM_", "GLOO_"))}


def run(config: Path, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv(config), cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def actor_logs(run_dir: Path) -> str:
    return "".join(p.read_text() for p in sorted((run_dir / "logs").glob("*/actor-0.*")))


@dataclass(frozen=True)
class KlRuns:
    """The module's runs: `one` (DP = 1, stopped by SIGUSR2 after step `stopped`, then resumed), `two` (DP = 2)."""

    one: Path
    two: Path
    stopped: int


@pytest.fixture(scope="module")
def kl_runs(micro_models: Path, tmp_path_factory: pytest.TempPathFactory) -> KlRuns:
    tmp_path = tmp_path_factory.mktemp("kl")
    changes = {"steps": STEPS, "checkpoint_interval": STEPS, "data.samples_per_prompt": 2}
    one, two = tmp_path / "dp1", tmp_path / "dp2"
    config = dp_config(micro_models, one, tmp_path / "dp1.yaml", 1, **changes)
    first = subprocess.Popen(
        argv(config), cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    wait_for_lines(one, 2, first)
    os.kill(actor_pid(one), signal.SIGUSR2)  # checkpoint after this step, end cleanly
    out, _ = first.communicate(timeout=120)
    assert first.returncode == 0, out[-3000:]
    stopped = latest_step(one)
    run(config)
    run(dp_config(micro_models, two, tmp_path / "dp2.yaml", 2, **changes))
    return KlRuns(one, two, stopped)


def test_kl_run_stops_and_resumes_with_the_starting_weights_as_reference(micro_models, kl_runs):
    run_dir, stopped = kl_runs.one, kl_runs.stopped
    assert 2 <= stopped < STEPS
    lines = read_metrics(run_dir / "metrics.jsonl")
    assert [x["step"] for x in lines] == list(range(1, STEPS + 1))
    kl = {x["step"]: x["ref/kl"] for x in lines}
    assert kl[1] == 0.0  # step 1: the policy is the reference
    assert all(kl[s] > 0 for s in range(2, STEPS + 1)), kl
    assert kl[stopped + 1] > 0  # the first resumed step: the reference is not the checkpoint
    for x in lines:
        assert x["loss/rl"] != 0.0 and x["time/reference_s"] > 0
        assert x["time/teacher_s"] >= x["time/reference_s"]
    logs = actor_logs(run_dir)
    source = f"reference model from {micro_models / 'student'} (the starting actor)"
    assert logs.count(source) == 2, logs[-3000:]  # the first run and the resumed one
    assert f"(step {stopped})" in logs
    assert json.loads((run_dir / "state" / "job_end.json").read_text())["reason"] == "finished"


def test_dp2_kl_run_equals_dp1(kl_runs):
    one, two = (read_metrics(run_dir / "metrics.jsonl") for run_dir in (kl_runs.one, kl_runs.two))
    assert [x["step"] for x in one] == [x["step"] for x in two] == list(range(1, STEPS + 1))
    assert one[0]["ref/kl"] == two[0]["ref/kl"] == 0.0
    for a, b in zip(one, two, strict=True):
        assert b["loss/total"] == pytest.approx(a["loss/total"], rel=1e-5, abs=1e-7)
        assert b["loss/rl"] == pytest.approx(a["loss/rl"], rel=1e-5, abs=1e-7)
        assert b["ref/kl"] == pytest.approx(a["ref/kl"], rel=1e-4, abs=1e-9)
    assert one[-1]["ref/kl"] > 0
