"""Resuming in a run directory: mopd-submit refuses a config that changes what the checkpoint was built on
(`launch/resume.py`), and the local backend says how a job ended without showing an older run's table."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mopd_hpc.config import load_run_config
from mopd_hpc.launch.local_setup import after_local_run
from mopd_hpc.launch.resume import ResumeError, check_resume
from mopd_hpc.records.job_end import write_job_end
from mopd_hpc.trainer.checkpoint import save_checkpoint
from mopd_hpc.trainer.evaluate import write_eval

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "local_cpu.yaml"


def checkpointed_run(tmp_path: Path, *overrides: str) -> Path:
    """A run dir as a checkpointed run leaves it: config.yaml (with `overrides`) and a real checkpoint (a
    tiny engine state) with checkpoints/latest naming it."""
    run = tmp_path / "run"
    save_checkpoint(run / "checkpoints", 30, {"model": {"w": torch.zeros(2)}}, data_state={"position": 30})
    (run / "config.yaml").write_text(load_run_config(CONFIG, ["steps=30", *overrides]).to_yaml())
    return run


def test_same_settings_resume_from_the_latest_checkpoint(tmp_path: Path) -> None:
    run = checkpointed_run(tmp_path)
    changed_loss = load_run_config(CONFIG, ["steps=30", "models.actor.optimizer.lr=1e-4", "loss.topk=8"])
    assert check_resume(run, changed_loss) == "step_000030"  # the loss and the lr may change
    assert check_resume(tmp_path / "fresh", changed_loss) is None


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("steps=35", "steps: the run in {run} was checkpointed (step_000030) with steps = 30, this config has 35"),
        ("seed=1", "seed: the run in {run} was checkpointed (step_000030) with seed = 0, this config has 1"),
        ("data.batch_size=64", "data.batch_size: the run in {run} was checkpointed (step_000030) with "
         "data.batch_size = 128, this config has 64"),
        ("data.sources[0].task_args.max_terms=4", "data.sources: the run in {run} was checkpointed"),
    ],
)  # fmt: skip
def test_changing_the_data_stream_on_resume_is_refused(tmp_path: Path, override: str, message: str) -> None:
    run = checkpointed_run(tmp_path)
    with pytest.raises(ResumeError) as err:
        check_resume(run, load_run_config(CONFIG, ["steps=30", override]))
    assert message.format(run=run) in str(err.value)
    assert "start a new run with --run-dir" in str(err.value)


def test_mopd_submit_refuses_before_anything_starts(tmp_path: Path) -> None:
    run = checkpointed_run(tmp_path)
    before = (run / "config.yaml").read_text()
    proc = subprocess.run(
        [sys.executable, "-m", "mopd_hpc.cli.submit", str(CONFIG), "--local", "--resume", str(run), "--set", "steps=35"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "mopd-submit: steps: the run in" in proc.stderr and "this config has 35" in proc.stderr
    assert (run / "config.yaml").read_text() == before  # the run's config is left as it was
    assert not (run / "plan.json").exists()


def test_after_a_local_job_the_terminal_says_how_it_ended(tmp_path: Path) -> None:
    write_eval(
        tmp_path, {"routes": {"chain": {"teacher": 1.0, "student_start": 0.3, "student_end": 0.9, "n": 5}}}
    )

    def said(rc: int, job_id: str) -> str:
        out = io.StringIO()
        after_local_run(tmp_path, out, None, rc, job_id)
        return out.getvalue()

    assert "chain" in said(0, "local-1") and "90.0%" in said(0, "local-1")  # finished: the table
    failed = said(1, "local-1")
    assert "90.0%" not in failed  # an older table would read as this job's result
    assert f"[local] the job failed (exit code 1): `mopd-logs summarize {tmp_path}`" in failed
    write_job_end(tmp_path, "local-2", "checkpoint_signal", 44)
    assert said(0, "local-2").strip() == (
        "[local] stopped on a checkpoint signal after step 44: re-run the same command to resume"
    )
    assert "90.0%" in said(0, "local-3")  # another job's stop record is not this job's
