"""Fault: SIGKILL of the actor, of a teacher and of the rollout server mid-run, each followed by the same
command again on the same run dir (a resume from the newest checkpoint; one is written every step).

Kept: every step's losses and gradient norm equal, bitwise, those of an uninterrupted run of the same config;
each step has exactly one metrics line; the data stream's position ends where the uninterrupted run's does.
Bitwise is expected, not a tolerance: the rollout's sampling is a pure function of (run seed, step, prompt)
(`trainer/rollout_phase.sampling_seed`, `engines/rollout/counter_rng.py`), a checkpoint holds the weights, the
optimizer state and the data position exactly, and the resumed rollout engines get the checkpoint's weights
by the same broadcast; both runs use the same CPU thread counts.

One interrupted run carries the three kills in turn (the actor after step 1's line, a teacher after step 3's,
the rollout after step 5's), to keep the test at four short jobs; the uninterrupted run is conftest's
`plain_run` (run once for the test run, shared with the other tests that compare with such a run).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
from helpers_jobs import PLAIN_STEPS, plain_config
from helpers_wait import until
from test_local_backend import env_for, processes_of

from mopd_hpc.config import RunConfig
from mopd_hpc.records.metrics import read_metrics

STEPS = PLAIN_STEPS
#: What must equal the uninterrupted run's, step by step.
KEPT = (
    "loss/total",
    "mopd/teacher_student_gap",
    "mopd/logprob_mismatch",
    "train/grad_norm",
    "train/response_tokens",
)


def submit(config: Path, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mopd_hpc.cli.submit", str(config), "--local"], cwd=cwd,
                            env=env_for(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip


def child_pid(run_dir: Path, role: str, index: int) -> int:
    for record in (run_dir / "ports").glob("*.json"):
        for child in json.loads(record.read_text())["children"]:
            if (child["role"], child["index"]) == (role, index):
                return int(child["pid"])
    raise AssertionError(f"no {role}[{index}] in {run_dir / 'ports'}")


def lines_or_end(run_dir: Path, count: int, proc: subprocess.Popen) -> bool:
    return len(read_metrics(run_dir / "metrics.jsonl")) >= count or proc.poll() is not None


def kept(run_dir: Path) -> dict[int, tuple[float, ...]]:
    lines = read_metrics(run_dir / "metrics.jsonl")
    steps = [line["step"] for line in lines]
    assert steps == sorted(set(steps)), steps  # one line per step, in order
    return {line["step"]: tuple(line[k] for k in KEPT) for line in lines}


def final_position(run_dir: Path) -> int:
    state = run_dir / "checkpoints" / f"step_{STEPS:06d}" / "state.json"
    return json.loads(state.read_text())["data_state"]["position"]


@pytest.mark.slow
def test_sigkill_of_actor_teacher_rollout_then_resume_equals_an_uninterrupted_run(
    micro_models, plain_run, tmp_path
):  # noqa: F811
    ref_dir = plain_run.run_dir  # the same config on another run dir, uninterrupted
    reference = kept(ref_dir)
    assert sorted(reference) == list(range(1, STEPS + 1))

    run_dir = tmp_path / "interrupted"
    run_config = plain_config(micro_models, run_dir, tmp_path / "interrupted.yaml")
    ours, theirs = RunConfig.from_yaml(run_config), RunConfig.from_yaml(ref_dir / "config.yaml")
    assert ours.model_copy(update={"run_dir": theirs.run_dir}) == theirs  # the same run on another run dir
    for after, (role, index) in ((1, ("actor", 0)), (3, ("teacher", 0)), (5, ("rollout", 0))):
        proc = submit(run_config, tmp_path)
        try:
            assert until(partial(lines_or_end, run_dir, after, proc), 240, 0.02)
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            os.kill(child_pid(run_dir, role, index), signal.SIGKILL)  # the fault
            out, _ = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode != 0, f"{role}: {out[-3000:]}"  # the guard ended the job
        assert until(lambda: processes_of(run_dir) == [], 15), (role, processes_of(run_dir))
        done = kept(run_dir)
        assert all(done[s] == reference[s] for s in done), (role, done, reference)
    last = submit(run_config, tmp_path)
    out, _ = last.communicate(timeout=300)
    assert last.returncode == 0, out[-3000:]
    assert kept(run_dir) == reference  # every step, bitwise
    assert final_position(run_dir) == final_position(ref_dir)
