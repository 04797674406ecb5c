"""The TRAIN phase's parts (`time/train/{prepare,forward_backward,optimizer}_s`, records/metrics_schema.py):
`SpanClock` (engines/span_clock.py) on CPU and, with `torch.cuda.synchronize` recorded, its CUDA boundaries;
`ShardStep.run` (trainer/rank_step.py) on a real torch engine with a `before_train` of known length; and
`step_metrics` writing the three keys.

Oracles: `time.sleep` of a known length inside a span; the parts of a call never add up to more than the call.
"""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import pytest
import torch
from helpers_models import save_micro_qwen3

from mopd_hpc.config.loss import LossConfig
from mopd_hpc.config.models import OptimizerConfig
from mopd_hpc.engines.span_clock import SpanClock, device_sync
from mopd_hpc.engines.torch.engine import TorchTrainEngine
from mopd_hpc.mopd.plan import ExecutionPlan
from mopd_hpc.records.metrics_schema import TRAIN_SPAN_KEYS
from mopd_hpc.trainer.group import SoloGroup
from mopd_hpc.trainer.rank_step import ShardStep
from mopd_hpc.trainer.step_record import ControlRecord

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
OUTPUTS = [[11, 12, 13, 14], [15], [16, 17], [18, 19, 20]]
GRPO = LossConfig(estimator="sampled", correction="none", distillation_coefficient=0.0, rl_coefficient=1.0)


def test_span_clock_laps_consecutive_spans_on_cpu_without_synchronizing(monkeypatch):
    synced: list[object] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    clock = SpanClock(torch.device("cpu"))
    t0 = time.perf_counter()
    clock.start()
    time.sleep(0.02)
    first = clock.lap("a")
    time.sleep(0.01)
    clock.skip()  # dropped: no span is named for it
    time.sleep(0.01)
    clock.lap("b")
    clock.lap("a")  # a name lapped twice adds up
    total = time.perf_counter() - t0
    assert first >= 0.02 and clock.spans["a"] >= first and clock.spans["b"] >= 0.01
    assert list(clock.spans) == ["a", "b"]
    assert clock.spans["a"] + clock.spans["b"] <= total - 0.01
    assert synced == []  # CPU: no device synchronization


def test_span_clock_synchronizes_a_cuda_device_at_every_boundary(monkeypatch):
    synced: list[object] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    cuda1 = torch.device("cuda", 1)
    clock = SpanClock(cuda1)
    clock.start()
    clock.lap("fb")
    clock.skip()
    clock.lap("opt")
    assert synced == [cuda1] * 4
    device_sync("cuda:0")
    device_sync(None)
    device_sync("meta")
    assert synced[4:] == [torch.device("cuda", 0)]
    with pytest.raises(AssertionError, match="before SpanClock.start"):
        SpanClock(None).lap("x")


def step_record() -> ControlRecord:
    rows = [p + o for p, o in zip(PROMPTS, OUTPUTS, strict=True)]
    width = max(map(len, OUTPUTS))
    mu = torch.full((len(rows), width), -3.0)
    return ControlRecord.from_rows(
        1, rows, [len(p) for p in PROMPTS], ["r"] * 4, mu, torch.tensor([1.0, -1.0, 0.5, -0.5]), pad_id=0
    )


def test_shard_step_reports_prepare_and_the_engine_parts_within_train(tmp_path: Path):
    """A real GRPO train step on the torch engine: `before_train` (60 ms) is `prepare`, the engine's parts
    are its stats; prepare + forward_backward + optimizer ≤ train ≤ the call's wall time."""
    student = save_micro_qwen3(tmp_path / "student", 0, vocab_size=32)
    engine = TorchTrainEngine.from_pretrained(
        student, dtype="float32", device="cpu", optimizer=OptimizerConfig(lr=1e-2), loss=GRPO
    )
    plan = ExecutionPlan.from_config(GRPO, teachers=("t",))
    assert not plan.scores_before_train  # TRAIN only: the timings are "train" and its parts
    step = ShardStep(engine, {}, plan, GRPO, {}, SoloGroup())
    pause = 0.06
    t0 = time.perf_counter()
    outcome = asyncio.run(step.run(step_record(), before_train=lambda: time.sleep(pause)))
    wall = time.perf_counter() - t0
    timings, stats = outcome.timings, outcome.stats
    assert set(timings) == {"prepare", "train"}
    fb, opt = stats["time/train/forward_backward_s"], stats["time/train/optimizer_s"]
    assert all(math.isfinite(s) and s > 0 for s in (fb, opt))
    assert pause <= timings["prepare"] < pause + 0.5
    assert timings["prepare"] + fb + opt <= timings["train"] <= wall
    without = asyncio.run(step.run(step_record()))
    assert without.timings["prepare"] == 0.0


def test_step_metrics_writes_the_train_parts():
    from types import SimpleNamespace

    from mopd_hpc.trainer.step import step_metrics

    rollouts = SimpleNamespace(route_means=lambda: {}, response_tokens=10, starts=[3, 2])
    stats = {"loss": 1.0, "time/train/forward_backward_s": 0.5, "time/train/optimizer_s": 0.25}
    timings = {"rollout": 1.0, "train": 2.0, "prepare": 0.125}
    values = step_metrics(stats, rollouts, timings, GRPO, ())
    assert {k: values[k] for k in TRAIN_SPAN_KEYS} == {
        "time/train/prepare_s": 0.125,
        "time/train/forward_backward_s": 0.5,
        "time/train/optimizer_s": 0.25,
    }
    assert values["time/train_s"] == 2.0 and values["perf/tokens_per_s"] == pytest.approx(10 / 3.0)
    bare = step_metrics({"loss": 1.0}, rollouts, {"train": 2.0}, GRPO, ())  # an engine without the parts
    assert [bare[k] for k in TRAIN_SPAN_KEYS] == [0.0, 0.0, 0.0]
