"""A damaged newest checkpoint never blocks a run: real torch checkpoints written by save_checkpoint, then
damaged (truncated model.pt, empty state.json, a flipped byte, an empty or garbage `latest`): load_latest
reports each (a warning naming the file) and uses the previous good one, mopd-submit names it before any
child starts, and with none good both refuse naming the files. A local run resumes past a truncated one."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers_jobs import PLAIN_STEPS, PlainRun, plain_config, submit_local
from test_controller import assert_metrics

from mopd_hpc.config import load_run_config
from mopd_hpc.launch.resume import ResumeError, check_resume, resume_choice
from mopd_hpc.records.metrics import read_metrics
from mopd_hpc.trainer.checkpoint import CheckpointError, load_latest, save_checkpoint

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "local_cpu.yaml"


def three_checkpoints(root: Path) -> None:
    for step in (10, 20, 30):
        save_checkpoint(
            root, step, {"model": {"w": torch.full((64, 64), float(step))}}, data_state={"pos": step}
        )


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the tensor data: torch.load alone would not notice
    path.write_bytes(bytes(data))


S30 = "step_000030"
DAMAGES: dict[str, tuple[Callable[[Path], None], int, str]] = {
    # name: (damage, step loaded, the reported line's start relative to the root, then its reason)
    "truncated model.pt": (lambda r: truncate(r / S30 / "model.pt"), 20, f"{S30}/model.pt: "),
    "empty state.json": (lambda r: (r / S30 / "state.json").write_text(""), 20, f"{S30}/state.json: 0 bytes"),
    "flipped byte": (lambda r: flip_a_byte(r / S30 / "model.pt"), 20, f"{S30}/model.pt: SHA-256 differs"),
    "no manifest, truncated": (
        lambda r: ((r / S30 / "manifest.json").unlink(), truncate(r / S30 / "model.pt")),
        20,
        f"{S30}/model.pt: not a whole torch file",
    ),
    "garbage manifest": (
        lambda r: (r / S30 / "manifest.json").write_text("{"),
        20,
        f"{S30}/manifest.json: unreadable",
    ),
    "empty latest": (lambda r: (r / "latest").write_text(""), 30, "latest: empty; expected a name like"),
    "garbage latest": (lambda r: (r / "latest").write_bytes(b"\x00\xffjunk"), 30, "latest: "),
    "latest names a missing step": (
        lambda r: (r / "latest").write_text("step_000040\n"),
        30,
        "step_000040: missing",
    ),
}


@pytest.mark.parametrize("case", DAMAGES, ids=list(DAMAGES))
def test_a_damaged_newest_checkpoint_is_reported_and_the_previous_good_one_loaded(
    tmp_path: Path, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    damage, step, report = DAMAGES[case]
    three_checkpoints(tmp_path)
    damage(tmp_path)
    with caplog.at_level(logging.WARNING, logger="mopd_hpc.trainer.checkpoint"):
        loaded = load_latest(tmp_path)
    assert loaded is not None and loaded.step == step and loaded.data_state == {"pos": step}
    assert torch.equal(loaded.engine_state["model"]["w"], torch.full((64, 64), float(step)))
    (line,) = loaded.skipped
    assert line.startswith(f"{tmp_path}/{report}"), line
    if step == 20:  # a damaged directory (a damaged pointer is no warning of its own: the walk says it)
        assert [r.getMessage() for r in caplog.records] == [f"checkpoint skipped: {line}"]


def test_the_submit_side_names_the_fallback_before_any_child_starts(tmp_path: Path) -> None:
    three_checkpoints(tmp_path / "run" / "checkpoints")
    truncate(tmp_path / "run" / "checkpoints" / S30 / "model.pt")
    choice = resume_choice(tmp_path / "run")
    assert choice.name == "step_000020"
    (line,) = choice.skipped
    size = (tmp_path / "run" / "checkpoints" / S30 / "model.pt").stat().st_size
    assert line.startswith(f"{tmp_path}/run/checkpoints/{S30}/model.pt: {size} bytes, the manifest says ")
    # A flipped byte keeps the size: the shallow (submit) check passes, the actor's deep one falls back.
    flip_a_byte(tmp_path / "run" / "checkpoints" / "step_000020" / "model.pt")
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_000010")
    assert resume_choice(tmp_path / "run").name == "step_000020"
    with pytest.raises(CheckpointError) as info:
        load_latest(tmp_path / "run" / "checkpoints")
    assert f"no good checkpoint under {tmp_path}/run/checkpoints: " in str(info.value)
    assert f"{S30}/model.pt: {size} bytes" in str(info.value)
    assert "step_000020/model.pt: SHA-256 differs from the manifest's" in str(info.value)


def test_with_no_good_checkpoint_mopd_submit_refuses_naming_the_file(tmp_path: Path) -> None:
    run = tmp_path / "run"
    save_checkpoint(run / "checkpoints", 30, {"model": {"w": torch.zeros(2)}})
    (run / "checkpoints" / S30 / "state.json").write_text("")
    cfg = load_run_config(CONFIG, ["steps=30"])
    (run / "config.yaml").write_text(cfg.to_yaml())
    with pytest.raises(ResumeError, match=rf"no good checkpoint in {run}/checkpoints to resume from: "):
        check_resume(run, cfg)
    proc = subprocess.run(
        [sys.executable, "-m", "mopd_hpc.cli.submit", str(CONFIG), "--local", "--resume", str(run), "--set", "steps=30"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"mopd-submit: no good checkpoint in {run}/checkpoints to resume from: ")
    assert f"{run}/checkpoints/{S30}/state.json: 0 bytes, the manifest says " in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (run / "plan.json").exists() and not (run / "logs").exists()  # nothing started


def test_a_checkpoint_without_a_manifest_is_accepted_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    three_checkpoints(tmp_path)
    (tmp_path / S30 / "manifest.json").unlink()  # as written before manifests existed
    with caplog.at_level(logging.WARNING, logger="mopd_hpc.trainer.checkpoint"):
        loaded = load_latest(tmp_path)
    assert loaded is not None and loaded.step == 30 and loaded.skipped == ()
    assert [r.getMessage() for r in caplog.records] == [
        f"checkpoint {tmp_path / S30} has no manifest.json (written before checkpoints carried one): "
        "accepted on its zip CRCs"
    ]
    flip_a_byte(tmp_path / S30 / "model.pt")  # no manifest: the zip's CRC-32 still catches it
    loaded = load_latest(tmp_path)
    assert loaded.step == 20 and "fails its CRC-32" in loaded.skipped[0]


def test_a_local_run_resumes_past_a_truncated_newest_checkpoint(
    micro_models: Path, plain_run: PlainRun, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"  # a copy of the shared finished run (a checkpoint every step), damaged here
    shutil.copytree(plain_run.run_dir, run_dir, symlinks=True)
    config = plain_config(micro_models, run_dir, tmp_path / "c.yaml")
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step_{PLAIN_STEPS:06d}\n"
    truncate(run_dir / "checkpoints" / f"step_{PLAIN_STEPS:06d}" / "model.pt")
    again = submit_local(config, cwd=tmp_path)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    bad = run_dir / "checkpoints" / f"step_{PLAIN_STEPS:06d}" / "model.pt"
    good = PLAIN_STEPS - 1
    assert f"# warning: checkpoint skipped: {bad}: " in again.stdout
    assert f"resuming the run in {run_dir} from checkpoints/step_{good:06d}" in again.stdout
    actor_out = next((run_dir / "logs").glob("*/actor-0.g1.out")).read_text()  # both jobs' (appended)
    assert f"checkpoint skipped: {bad}: " in actor_out
    assert f"resuming from {run_dir / 'checkpoints' / f'step_{good:06d}'} (step {good})" in actor_out
    assert_metrics(run_dir, PLAIN_STEPS)  # the last step rerun: one line per step
    kept = read_metrics(plain_run.run_dir / "metrics.jsonl")[:good]
    assert read_metrics(run_dir / "metrics.jsonl")[:good] == kept  # the lines before it, as written
    state = json.loads((run_dir / "checkpoints" / f"step_{PLAIN_STEPS:06d}" / "state.json").read_text())
    assert (
        state["step"] == PLAIN_STEPS
        and (run_dir / "checkpoints" / f"step_{PLAIN_STEPS:06d}" / "manifest.json").is_file()
    )
    assert load_latest(run_dir / "checkpoints").skipped == ()  # the rerun's save replaced the damaged one
