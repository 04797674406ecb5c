"""Atomic checkpoints: crash safety, keep-last-N, and resume equality with a real micro train engine."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from helpers_models import save_micro_qwen3

from mopd_hpc.config.loss import LossConfig
from mopd_hpc.config.models import OptimizerConfig
from mopd_hpc.engines.batch import TokenBatch, TrainBatch
from mopd_hpc.engines.torch.engine import TorchTrainEngine
from mopd_hpc.mopd.targets import aggregate_teacher_targets
from mopd_hpc.trainer import checkpoint as ckpt
from mopd_hpc.trainer.checkpoint import (
    CheckpointError,
    capture_rng_state,
    list_checkpoints,
    load_latest,
    restore_rng_state,
    save_checkpoint,
)

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
OUTPUTS = [[11, 12, 13], [15], [16, 17]]


def small_state(value: float) -> dict:
    return {"model": {"w": torch.full((2, 3), value)}, "optimizer": {"state": {}, "param_groups": []}}


def test_save_then_load_round_trips(tmp_path):
    rng = capture_rng_state()
    path = save_checkpoint(
        tmp_path, 50, small_state(1.5), data_state={"cursor": 7, "epoch": 1}, rng_state=rng, extra={"m": 3}
    )
    assert path == tmp_path / "step_000050"
    assert (tmp_path / "latest").read_text() == "step_000050\n"
    loaded = load_latest(tmp_path)
    assert loaded is not None and loaded.step == 50 and loaded.path == path
    assert torch.equal(loaded.engine_state["model"]["w"], torch.full((2, 3), 1.5))
    assert loaded.data_state == {"cursor": 7, "epoch": 1} and loaded.extra == {"m": 3}
    assert torch.equal(loaded.rng_state["torch"], rng["torch"])
    assert load_latest(tmp_path / "nothing-here") is None


def test_crash_inside_the_writer_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, small_state(1.0), data_state={"cursor": 1})
    real_save = torch.save

    def dying_save(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint")
        raise OSError("No space left on device")

    monkeypatch.setattr(ckpt.torch, "save", dying_save)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(tmp_path, 2, small_state(2.0), data_state={"cursor": 2})
    monkeypatch.setattr(ckpt.torch, "save", real_save)
    loaded = load_latest(tmp_path)
    assert loaded is not None and loaded.step == 1 and loaded.data_state == {"cursor": 1}
    assert torch.equal(loaded.engine_state["model"]["w"], torch.full((2, 3), 1.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000001"]


def test_crash_before_the_pointer_update_and_stale_temp_dirs(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, small_state(1.0))

    def dying_pointer(*args, **kwargs):
        raise KeyboardInterrupt  # e.g. the job killed between the directory rename and the pointer write

    monkeypatch.setattr(ckpt, "atomic_write_text", dying_pointer)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, small_state(2.0))
    monkeypatch.undo()
    assert load_latest(tmp_path).step == 1  # the pointer still names step 1
    stale = tmp_path / ".step_000003.tmp-99999"  # what a SIGKILL mid-write leaves
    stale.mkdir()
    (stale / "model.pt").write_bytes(b"junk")
    assert load_latest(tmp_path).step == 1
    save_checkpoint(tmp_path, 3, small_state(3.0))
    assert not stale.exists() and load_latest(tmp_path).step == 3


def test_keep_last_n(tmp_path):
    for step in range(1, 6):
        save_checkpoint(tmp_path, step * 10, small_state(step), keep_last=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [40, 50]
    assert load_latest(tmp_path).step == 50
    save_checkpoint(tmp_path, 50, small_state(9.0), keep_last=2)  # re-saving a step replaces it
    assert float(load_latest(tmp_path).engine_state["model"]["w"][0, 0]) == 9.0


def test_bad_arguments_and_broken_pointer(tmp_path):
    with pytest.raises(CheckpointError, match="not JSON-serializable"):
        save_checkpoint(tmp_path, 1, small_state(1.0), data_state={"x": object()})
    assert not (tmp_path / "latest").exists()
    with pytest.raises(CheckpointError, match="keep_last is 0"):
        save_checkpoint(tmp_path, 1, small_state(1.0), keep_last=0)
    (tmp_path / "latest").write_text("step_000009\n")
    with pytest.raises(CheckpointError, match="has no model.pt"):
        load_latest(tmp_path)


@pytest.fixture(scope="module")
def student(tmp_path_factory) -> Path:
    return save_micro_qwen3(tmp_path_factory.mktemp("ckpt") / "student", 0, initializer_range=0.2)


def engine_for(path: Path) -> TorchTrainEngine:
    return TorchTrainEngine.from_pretrained(
        path, dtype="float32", device="cpu", optimizer=OptimizerConfig(lr=1e-2), loss=LossConfig()
    )


def random_batch(engine: TorchTrainEngine) -> TrainBatch:
    """A step's batch drawn from the python and torch RNGs (as a data stream and a sampler would)."""
    order = random.sample(range(len(PROMPTS)), k=len(PROMPTS))
    tokens = TokenBatch.from_samples([PROMPTS[i] for i in order], [OUTPUTS[i] for i in order], pad_id=0)
    mu = engine.logprobs(tokens).clone()
    teacher = mu - 0.5 + 0.3 * torch.randn(mu.shape)
    targets = aggregate_teacher_targets({"t": teacher}, [{"t": 1.0}] * len(order))
    return TrainBatch.create(tokens, mu, targets=targets)


def test_resume_restores_optimizer_and_rng_so_the_next_step_is_equal(student, tmp_path):
    random.seed(1)
    torch.manual_seed(1)
    first = engine_for(student)
    for _ in range(2):
        first.train_step(random_batch(first))
    save_checkpoint(tmp_path, 2, first.state_dict(), data_state={"cursor": 2})
    want = first.train_step(random_batch(first))
    want_params = {n: p.detach().clone() for n, p in first.model.named_parameters()}

    random.seed(123)  # a new process: other RNG states, a freshly loaded model
    torch.manual_seed(123)
    resumed = engine_for(student)
    loaded = load_latest(tmp_path)
    resumed.load_state_dict(loaded.engine_state)
    restore_rng_state(loaded.rng_state)
    assert loaded.data_state == {"cursor": 2} and resumed.steps == 2
    got = resumed.train_step(random_batch(resumed))
    assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]
    for name, param in resumed.model.named_parameters():
        assert torch.equal(param, want_params[name]), name

    # The test can tell: without the optimizer state, the same step gives other parameters.
    fresh = engine_for(student)
    fresh.model.load_state_dict(loaded.engine_state["model"])
    restore_rng_state(loaded.rng_state)
    fresh.train_step(random_batch(fresh))
    assert any(not torch.equal(p, want_params[n]) for n, p in fresh.model.named_parameters())
