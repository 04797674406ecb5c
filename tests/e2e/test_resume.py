"""Resume through the local backend: the actor is SIGKILLed mid-run (the guard then stops the job), the same
command is run again on the same run directory, and the metrics file proves no step was lost or repeated; the
data stream continues where the checkpoint says. SIGUSR2 to the actor: checkpoint now, the job ends cleanly
(exit 0, servers stopped), and a rerun finishes the remaining steps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from test_controller import assert_metrics, micro_config

from mopd_hpc.records.metrics import read_metrics

#: The SIGUSR2 test's run: the signal goes after 5 metrics lines and takes effect after the step in flight, so
#: 20 steps leave it 15 to land in; the rerun trains the rest (80 steps spent 75 of them there: ~2 min of CPU).
STEPS = 20
#: The SIGKILL test's run: a checkpoint every `KILL_INTERVAL` steps, the actor killed after `KILL_AFTER` lines
#: (one checkpoint behind it at least, lines past it to roll back).
KILL_STEPS, KILL_INTERVAL, KILL_AFTER = 12, 4, 6
BATCH = 8


def submit(config: Path, cwd: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOPD_", "SLURM_"))}
    return subprocess.Popen(
        [sys.executable, "-m", "mopd_hpc.cli.submit", str(config), "--local"],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def actor_pid(run_dir: Path) -> int:
    for record in (run_dir / "ports").glob("*.json"):
        for child in json.loads(record.read_text())["children"]:
            if child["role"] == "actor":
                return int(child["pid"])
    raise AssertionError(f"no actor in {run_dir / 'ports'}")


def wait_for_lines(run_dir: Path, count: int, proc: subprocess.Popen, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while len(read_metrics(run_dir / "metrics.jsonl")) < count:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        assert time.monotonic() < deadline, f"fewer than {count} metrics lines after {timeout_s} s"
        time.sleep(0.02)


def latest_step(run_dir: Path) -> int:
    name = (run_dir / "checkpoints" / "latest").read_text().strip()
    return json.loads((run_dir / "checkpoints" / name / "state.json").read_text())["step"]


def finish_again(config: Path, cwd: Path, run_dir: Path, steps: int = STEPS) -> str:
    again = submit(config, cwd)
    out, _ = again.communicate(timeout=300)
    assert again.returncode == 0, out[-3000:]
    lines = assert_metrics(run_dir, steps)
    assert len({line["step"] for line in lines}) == steps
    final = json.loads((run_dir / "checkpoints" / f"step_{steps:06d}" / "state.json").read_text())
    assert final["data_state"]["position"] == steps * BATCH  # the stream continued, no draw repeated
    return out


def test_sigkill_mid_run_then_rerun_loses_and_repeats_no_step(micro_models, tmp_path):
    run_dir = tmp_path / "run"
    config = micro_config(
        micro_models,
        run_dir,
        tmp_path / "c.yaml",
        steps=KILL_STEPS,
        checkpoint_interval=KILL_INTERVAL,
        **{"data.eval.size": 4},
    )
    first = submit(config, tmp_path)
    wait_for_lines(run_dir, KILL_AFTER, first)
    os.kill(actor_pid(run_dir), signal.SIGKILL)
    killed_at = time.time()
    out, _ = first.communicate(timeout=120)
    assert first.returncode == 128 + signal.SIGKILL, out[-2000:]  # the guard reports the killed actor
    ckpt = latest_step(run_dir)
    before = {line["step"]: line["ts"] for line in read_metrics(run_dir / "metrics.jsonl")}
    assert KILL_INTERVAL <= ckpt <= max(before) < KILL_STEPS  # usually ckpt < max: lines to roll back
    out = finish_again(config, tmp_path, run_dir, KILL_STEPS)
    actor_out = next((run_dir / "logs").glob("*/actor-0.g1.out")).read_text()
    assert f"resuming from {run_dir / 'checkpoints' / f'step_{ckpt:06d}'} (step {ckpt})" in actor_out
    after = {line["step"]: line["ts"] for line in read_metrics(run_dir / "metrics.jsonl")}
    assert all(after[s] == before[s] for s in range(1, ckpt + 1))  # kept as written before the kill
    assert all(after[s] > killed_at for s in range(ckpt + 1, KILL_STEPS + 1))  # rolled back and rerun
    assert "end/teacher" in out


def test_sigusr2_checkpoints_and_ends_the_job_cleanly(micro_models, tmp_path):
    run_dir = tmp_path / "run"
    config = micro_config(
        micro_models,
        run_dir,
        tmp_path / "c.yaml",
        steps=STEPS,
        checkpoint_interval=STEPS,  # the one periodic checkpoint is the last step's: the signal's is its own
        **{"data.eval.size": 4},
    )
    first = submit(config, tmp_path)
    wait_for_lines(run_dir, 5, first)
    os.kill(actor_pid(run_dir), signal.SIGUSR2)
    out, _ = first.communicate(timeout=120)
    assert first.returncode == 0, out[-3000:]
    done = read_metrics(run_dir / "metrics.jsonl")
    assert latest_step(run_dir) == done[-1]["step"] < STEPS  # checkpointed right after the last step
    end = json.loads((run_dir / "state" / "job_end.json").read_text())
    assert end["reason"] == "checkpoint_signal" and end["step"] == done[-1]["step"]
    finish_again(config, tmp_path, run_dir)
    assert json.loads((run_dir / "state" / "job_end.json").read_text())["reason"] == "finished"
