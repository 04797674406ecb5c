"""Resume through the local backend: the actor is SIGKILLed mid-run (the guard then stops the job), the same
command is run again on the same run directory, and the metrics file proves no step was lost or repeated; the
data stream continues where the checkpoint says. SIGUSR2 to the actor: checkpoint now, the job ends cleanly
(exit 0, servers stopped), and a rerun finishes the remaining steps.

Both tests assert on one run of three jobs (the module fixture `sequence`; a job costs ~30 CPU-s, nearly all of
it its children's imports): job 1 gets SIGUSR2 after a few steps and ends cleanly with the signal's checkpoint;
job 2 (the rerun) resumes from it and its actor is SIGKILLed a few steps later, with those steps to roll back;
job 3 (the rerun again) resumes from the same checkpoint and finishes. No periodic checkpoint but the last
step's: the signal's checkpoint is its own, and the kill rolls back to it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_controller import assert_metrics, micro_config

from mopd_hpc.records.metrics import read_metrics

#: The run's steps: SIGUSR2 goes after `SIGNAL_AFTER` metrics lines and takes effect after the step in flight
#: (step k), the rerun's actor is SIGKILLed after `KILL_PAST` more lines (k + 2 < 20 leaves the signal 15 steps
#: to land in), the last rerun trains the rest.
STEPS, SIGNAL_AFTER, KILL_PAST = 20, 3, 2
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


def actor_log(run_dir: Path) -> str:
    """The actor's stdout over every job of the run (the guard appends each generation's output)."""
    return next((run_dir / "logs").glob("*/actor-0.g1.out")).read_text()


@dataclass(frozen=True)
class Sequence:
    """The module's run of three jobs on one run directory (the module docstring)."""

    run_dir: Path
    signalled: subprocess.CompletedProcess[str]  # job 1: SIGUSR2
    signal_lines: list[dict]  # metrics after job 1
    signal_end: dict  # state/job_end.json after job 1
    signal_ckpt: int  # latest checkpoint after job 1
    rerun_log: str  # the actor's output of job 2
    killed: subprocess.CompletedProcess[str]  # job 2: its actor SIGKILLed
    killed_at: float
    kill_ckpt: int  # latest checkpoint after job 2
    before: dict[int, float]  # step → metrics line timestamp after job 2
    last_log: str  # the actor's output of job 3
    last_out: str  # job 3's `mopd-submit` output


@pytest.fixture(scope="module")
def sequence(micro_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Sequence:
    tmp_path = tmp_path_factory.mktemp("resume")
    run_dir = tmp_path / "run"
    config = micro_config(
        micro_models, run_dir, tmp_path / "c.yaml", steps=STEPS, checkpoint_interval=STEPS,
        **{"data.eval.size": 4},
    )  # fmt: skip
    first = submit(config, tmp_path)
    wait_for_lines(run_dir, SIGNAL_AFTER, first)
    os.kill(actor_pid(run_dir), signal.SIGUSR2)
    out, _ = first.communicate(timeout=120)
    signalled = subprocess.CompletedProcess(first.args, first.returncode, out, "")
    signal_lines = read_metrics(run_dir / "metrics.jsonl")
    signal_end = json.loads((run_dir / "state" / "job_end.json").read_text())
    signal_ckpt = latest_step(run_dir)
    assert first.returncode == 0 and signal_ckpt + KILL_PAST < STEPS, (signal_ckpt, out[-3000:])
    log_before = len(actor_log(run_dir))

    rerun = submit(config, tmp_path)
    wait_for_lines(run_dir, signal_ckpt + KILL_PAST, rerun)
    os.kill(actor_pid(run_dir), signal.SIGKILL)
    killed_at = time.time()
    out, _ = rerun.communicate(timeout=120)
    killed = subprocess.CompletedProcess(rerun.args, rerun.returncode, out, "")
    rerun_log = actor_log(run_dir)[log_before:]
    kill_ckpt = latest_step(run_dir)
    before = {line["step"]: line["ts"] for line in read_metrics(run_dir / "metrics.jsonl")}
    log_before = len(actor_log(run_dir))

    last_out = finish_again(config, tmp_path, run_dir)
    return Sequence(
        run_dir, signalled, signal_lines, signal_end, signal_ckpt, rerun_log, killed, killed_at, kill_ckpt,
        before, actor_log(run_dir)[log_before:], last_out,
    )  # fmt: skip


def test_sigkill_mid_run_then_rerun_loses_and_repeats_no_step(sequence: Sequence) -> None:
    run_dir, ckpt, before = sequence.run_dir, sequence.kill_ckpt, sequence.before
    assert sequence.killed.returncode == 128 + signal.SIGKILL, sequence.killed.stdout[
        -2000:
    ]  # the killed actor
    assert ckpt == sequence.signal_ckpt  # no checkpoint between the signal's and the kill
    assert ckpt < max(before) < STEPS  # lines past the checkpoint to roll back
    assert f"resuming from {run_dir / 'checkpoints' / f'step_{ckpt:06d}'} (step {ckpt})" in sequence.last_log
    after = {line["step"]: line["ts"] for line in read_metrics(run_dir / "metrics.jsonl")}
    assert sorted(after) == list(range(1, STEPS + 1))
    assert all(after[s] == before[s] for s in range(1, ckpt + 1))  # kept as written before the kill
    assert all(after[s] > sequence.killed_at for s in range(ckpt + 1, STEPS + 1))  # rolled back and rerun
    assert "end/teacher" in sequence.last_out


def test_sigusr2_checkpoints_and_ends_the_job_cleanly(sequence: Sequence) -> None:
    run_dir, done = sequence.run_dir, sequence.signal_lines
    assert sequence.signalled.returncode == 0, sequence.signalled.stdout[-3000:]
    assert sequence.signal_ckpt == done[-1]["step"] < STEPS  # checkpointed right after the last step
    assert (
        sequence.signal_end["reason"] == "checkpoint_signal"
        and sequence.signal_end["step"] == done[-1]["step"]
    )
    ckpt = sequence.signal_ckpt
    assert f"resuming from {run_dir / 'checkpoints' / f'step_{ckpt:06d}'} (step {ckpt})" in sequence.rerun_log
    assert json.loads((run_dir / "state" / "job_end.json").read_text())["reason"] == "finished"
