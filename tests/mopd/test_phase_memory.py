"""Peak GPU memory per phase (issue 21 item 3): `trainer/phase_memory.py` driven by a real phase machine over
the caching allocator's statistics (a recording stand-in of `torch.cuda`'s peak functions on CPU; the real
allocator in the gpu test), the metrics keys' contract, and `mopd-logs summarize` showing the peaks.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from mopd_hpc.logs.progress import read_progress
from mopd_hpc.logs.render import MEMORY_HEADING, _memory_table, render_summary
from mopd_hpc.logs.summary import no_sacct, summarize_run
from mopd_hpc.mopd.phases import PhaseMachine, Transition
from mopd_hpc.mopd.plan import Phase
from mopd_hpc.records.metrics_schema import memory_key, memory_of
from mopd_hpc.trainer.phase_memory import GIB, PhaseMemory


class FakeAllocator:
    """torch.cuda's peak statistics over a `current` allocation that the test moves."""

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self.resets = 0

    def alloc(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def reset_peak_memory_stats(self, device) -> None:
        assert device.type == "cuda"
        self.peak = self.current
        self.resets += 1

    def max_memory_allocated(self, device) -> int:
        return self.peak

    def max_memory_reserved(self, device) -> int:
        return 2 * self.peak


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeAllocator:
    alloc = FakeAllocator()
    for name in ("reset_peak_memory_stats", "max_memory_allocated", "max_memory_reserved"):
        monkeypatch.setattr(torch.cuda, name, getattr(alloc, name))
    return alloc


def test_peaks_per_phase_of_a_step_reset_at_each_phase(fake: FakeAllocator) -> None:
    memory = PhaseMemory(torch.device("cuda", 0))
    seen: list[Transition] = []
    machine = PhaseMachine(
        uses_teacher=True, consumers=("actor",), on_transition=memory.observer(seen.append)
    )
    fake.alloc(5 * 2**30)  # between steps (e.g. evaluation): not the rollout's
    fake.alloc(-5 * 2**30)
    memory.start_step()
    plan = [
        (Phase.TEACHER, 1),  # the rollout phase allocates 1 GiB (then frees it)
        (Phase.DRAIN, 3),
        (Phase.TRAIN, 0),
        (Phase.SYNC, 8),
        (Phase.ROLLOUT, 2),
    ]
    for target, gib in plan:
        fake.alloc(gib * 2**30)
        fake.alloc(-gib * 2**30)
        if target is Phase.TRAIN:
            from mopd_hpc.mopd.phases import DrainReceipt

            machine.receive(DrainReceipt("actor", machine.step, 1))
            machine.release_teacher()
        machine.transition(target)
    got = memory.take()
    assert len(seen) == 5  # the controller's own callback still runs
    want_alloc = {"rollout": 1, "teacher": 3, "drain": 0, "train": 8, "sync": 2}
    for phase, gib in want_alloc.items():
        assert got[memory_key("actor", phase, "allocated_gib")] == gib, phase
        assert got[memory_key("actor", phase, "reserved_gib")] == 2 * gib, phase
    assert len(got) == 10 and memory.take() == {}
    # ABORT ends the current phase; its peak is kept and merged (max) with the phase's rerun.
    memory.start_step()
    fake.alloc(4 * 2**30)
    memory.on_transition(Transition(1, Phase.ROLLOUT, Phase.ABORT))
    fake.alloc(-4 * 2**30)
    assert memory.take() == {
        "memory/actor/rollout/allocated_gib": 4.0,
        "memory/actor/rollout/reserved_gib": 8.0,
    }


def test_inactive_on_cpu(fake: FakeAllocator) -> None:
    for device in (None, torch.device("cpu")):
        memory = PhaseMemory(device)
        memory.start_step()
        memory.on_transition(Transition(0, Phase.ROLLOUT, Phase.TRAIN))
        assert not memory.active and memory.take() == {}
    assert fake.resets == 0
    assert not PhaseMemory.of_engine(object()).active


def test_memory_keys_contract() -> None:
    assert memory_key("actor", "train", "reserved_gib") == "memory/actor/train/reserved_gib"
    assert memory_of("memory/actor/train/reserved_gib") == ("actor", "train", "reserved_gib")
    assert memory_of("memory/teacher/math/score/allocated_gib") == ("teacher/math", "score", "allocated_gib")
    assert memory_of("memory/actor/train/other") is None
    assert memory_of("memory/train/reserved_gib") is None
    assert memory_of("time/train_s") is None


def test_summarize_shows_the_largest_peak_per_child_and_phase(tmp_path: Path) -> None:
    lines = []
    for step, train in ((1, 60.25), (2, 84.5), (3, 70.0)):
        lines.append(
            {
                "step": step,
                "ts": 1e9 + step,
                "time/train_s": 1.0,
                memory_key("actor", "rollout", "allocated_gib"): 1.0,
                memory_key("actor", "rollout", "reserved_gib"): 2.0,
                memory_key("actor", "train", "allocated_gib"): train,
                memory_key("actor", "train", "reserved_gib"): train + 10,
            }
        )
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    progress = read_progress(tmp_path)
    assert progress.memory == {
        "actor": {
            "rollout": {"allocated_gib": 1.0, "reserved_gib": 2.0},
            "train": {"allocated_gib": 84.5, "reserved_gib": 94.5},
        }
    }
    assert progress.to_dict()["memory"] == progress.memory
    buf = io.StringIO()
    Console(file=buf, width=120, color_system=None).print(_memory_table(progress.memory))
    text = buf.getvalue()
    row = next(line for line in text.splitlines() if line.strip().startswith("actor"))
    assert row.split() == ["actor", "1.0", "/", "2.0", "84.5", "/", "94.5"]
    header = next(line for line in text.splitlines() if "rollout" in line)
    assert header.index("rollout") < header.index("train")
    # In `mopd-logs summarize`'s training panel.
    buf = io.StringIO()
    render_summary(
        summarize_run(tmp_path, sacct_runner=no_sacct), Console(file=buf, width=160, color_system=None)
    )
    shown = buf.getvalue()
    assert MEMORY_HEADING in shown and "84.5 / 94.5" in shown
    # A CPU run reports no memory keys: nothing is shown.
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "ts": 1e9}) + "\n")
    assert read_progress(tmp_path).memory == {}


@pytest.mark.gpu
def test_real_allocator_peaks_per_phase() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    device = torch.device("cuda", torch.cuda.current_device())
    memory = PhaseMemory(device)
    memory.start_step()
    small = torch.empty(2**20, dtype=torch.uint8, device=device)  # 1 MiB in the rollout
    memory.on_transition(Transition(0, Phase.ROLLOUT, Phase.TRAIN))
    big = torch.empty(2**30, dtype=torch.uint8, device=device)  # 1 GiB in the train phase
    del big
    memory.on_transition(Transition(0, Phase.TRAIN, Phase.SYNC))
    memory.end()
    got = memory.take()
    del small
    assert got["memory/actor/train/allocated_gib"] >= 1.0
    assert got["memory/actor/rollout/allocated_gib"] < 1.0 - 2**20 / GIB
    assert got["memory/actor/train/reserved_gib"] >= got["memory/actor/train/allocated_gib"]
