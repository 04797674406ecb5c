"""A colocated sglang rollout engine gives its memory back at the phase boundaries (trainer/rollout_memory.py,
DESIGN.md §5), driven by the real controller over three steps.

Real parts: the sglang rollout role (roles/rollout_sglang.py) serving on 127.0.0.1 behind the job's token, the
controller with the torch train engine on the micro student (c_d = 0, GRPO: no teacher), the weight sync into
an engine of tensor-parallel size 2 (the torch broadcast over a real gloo group, or the ipc sync's shared
buffers through SGLang's update_weights_from_tensor: the one-GPU colocated path, a /dev/shm buffer here), the
start and end evaluation on the engine. The Engine is tests/engines/test_rollout_role_sglang.py's stand-in with
sglang.Engine's Python API (0.5.17's signatures; SGLang itself runs on the GPU machines only), made as strict
as SGLang: it refuses to release a tag twice, to resume one that is held, to generate while its weights or KV
cache are released, to load weights into released weights, and its memory methods must run off the server's
event-loop thread (they run an event loop of their own in SGLang); every rollout names the weight_version of
the last update (the server's).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml
from helpers_auth import TOKEN, write_run_dir_token
from helpers_configs import set_dotted, without_sft_warmup
from helpers_ports import free_port, free_ports
from test_rollout_role_sglang import TP, TPStandIn, role_env, start_role
from test_sglang_ipc import IpcStandIn

from mopd_hpc.config import RunConfig
from mopd_hpc.engines.weight_sync.ipc import tied_aliases
from mopd_hpc.mopd.phases import Phase
from mopd_hpc.records.metrics import read_metrics
from mopd_hpc.trainer.rollout_memory import CACHE_TAGS, RELEASED_TAGS, SYNC_TAGS, RolloutMemory

REPO = Path(__file__).resolve().parents[2]
STEPS, EVAL_SIZE = 3, 4

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class StrictStandIn(TPStandIn):
    """The TP stand-in with SGLang's memory rules (module docstring); `calls` as TPStandIn's."""

    def __init__(self, launch: Any) -> None:
        super().__init__(launch)
        self.released: set[str] = set()

    def generate(self, **kw: Any) -> Any:
        if self.released & {"weights", "kv_cache"}:
            raise RuntimeError(f"generate while {sorted(self.released)} are released")
        return super().generate(**kw)

    def update_weights_from_distributed(self, *args: Any, **kw: Any) -> tuple[bool, str]:
        if "weights" in self.released:
            raise RuntimeError("update_weights_from_distributed into released weights")
        return super().update_weights_from_distributed(*args, **kw)

    def _off_loop(self) -> None:
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop()
            raise AssertionError("an Engine memory method ran on the server's event-loop thread")

    def release_memory_occupation(self, tags: list[str]) -> None:
        self._off_loop()
        assert not self.released & set(tags), f"SGLang raises on a tag released twice: {tags}"
        self.calls.append(("release", list(tags)))
        self.released |= set(tags)

    def resume_memory_occupation(self, tags: list[str]) -> None:
        self._off_loop()
        assert set(tags) <= self.released, f"SGLang raises on resuming a tag that is held: {tags}"
        self.calls.append(("resume", list(tags)))
        self.released -= set(tags)


class StrictIpcStandIn(StrictStandIn, IpcStandIn):
    """The strict stand-in with SGLang 0.5.17's update_weights_from_tensor (tests/engines/test_sglang_ipc.py), which
    refuses to load into released weights."""

    def update_weights_from_tensor(self, *args: Any, **kw: Any) -> tuple[bool, str]:
        if "weights" in self.released:
            raise RuntimeError("update_weights_from_tensor into released weights")
        return super().update_weights_from_tensor(*args, **kw)


def sglang_run_config(models: Path, run_dir: Path, **changes: Any) -> RunConfig:
    """configs/local_cpu.yaml on the micro models with the sglang backend at TP 2, colocated, GRPO only (the
    stand-in needs no GPU: only the config's validation counts GPUs; the train engine runs on CPU here; no SFT
    warm-up: it is refused without distillation)."""
    doc = without_sft_warmup(yaml.safe_load((REPO / "configs" / "local_cpu.yaml").read_text()))
    doc["run_dir"] = str(run_dir)
    doc["models"]["actor"]["path"] = doc["models"]["tokenizer"]["path"] = str(models / "student")
    for teacher, name in zip(
        doc["models"]["teachers"], ("teacher_chain_sum", "teacher_leg_counting"), strict=True
    ):
        teacher["path"] = str(models / name)
    doc.update(steps=STEPS, checkpoint_interval=STEPS)
    set_dotted(
        doc,
        {
            "rollout.backend": "sglang",
            "rollout.engines.tensor_parallel": TP,
            "rollout.mode": "colocated",
            "cluster.group.gpus_per_node": TP,
            "data.batch_size": 4,
            "data.samples_per_prompt": 2,
            "data.eval.size": EVAL_SIZE,
            "loss.distillation_coefficient": 0.0,
            "loss.rl_coefficient": 1.0,
            **changes,
        },
    )
    return RunConfig.from_dict(doc)


async def controller_against_sglang_role(cfg: RunConfig, run_dir: Path) -> tuple[Any, Any, StrictStandIn]:
    """The sglang role in this process (the strict stand-in), then the controller of a one-rank actor on it."""
    from transformers import AutoTokenizer

    from mopd_hpc.engines.rollout.client import RolloutClient
    from mopd_hpc.engines.torch.engine import TorchTrainEngine
    from mopd_hpc.mopd.plan import ExecutionPlan
    from mopd_hpc.trainer.controller import Controller
    from mopd_hpc.trainer.data_setup import build_run_data
    from mopd_hpc.trainer.weight_sync import IpcSync, SyncSettings, TorchSync

    ipc = cfg.weight_sync.backend == "ipc"
    role = role_env(run_dir, free_ports(3))
    task, stop, record, stand_in = await start_role(role, cfg, StrictIpcStandIn if ipc else StrictStandIn)
    try:
        actor = cfg.models.actor
        engine = TorchTrainEngine.from_pretrained(
            actor.path, dtype=actor.dtype, device="cpu", optimizer=actor.optimizer, loss=cfg.loss,
            total_steps=cfg.steps,
        )  # fmt: skip
        async with RolloutClient(record["url"], token=TOKEN) as client:
            controller = Controller(
                cfg,
                ExecutionPlan.from_config(cfg.loss, teachers=cfg.models.teacher_ids),
                engine,
                AutoTokenizer.from_pretrained(cfg.models.tokenizer.path),
                build_run_data(cfg),
                rollout=[client],
                teachers={},
                sync=IpcSync(engine)
                if ipc
                else TorchSync(
                    engine, SyncSettings("127.0.0.1", free_port(), "gloo"), 60, ranks_per_server=TP
                ),
                run_dir=run_dir,
                job_id="local-7",
                out=io.StringIO(),
            )
            outcome = await controller.run()
    finally:
        stop.set()
        await task
    return controller, outcome, stand_in


@pytest.mark.parametrize("sync", ["torch", "ipc"])
def test_colocated_sglang_releases_after_rollout_and_resumes_around_the_sync(micro_models, tmp_path, sync):
    """The torch broadcast into the engine's TP workers, or the ipc sync's shared buffers through SGLang's
    update_weights_from_tensor (the one-GPU colocated path): the same order of calls."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_run_dir_token(run_dir)
    cfg = sglang_run_config(micro_models, run_dir, **{"weight_sync.backend": sync})
    controller, outcome, engine = asyncio.run(controller_against_sglang_role(cfg, run_dir))
    assert (outcome.reason, outcome.step) == ("finished", STEPS)

    loaded = {"names": list(engine.loaded[0])} if sync == "ipc" else {}
    calls = [
        ("update", loaded) if kind == "update_tensor" else (kind, kw)
        for kind, kw in engine.calls
        if kind in ("generate", "release", "resume", "update", "update_tensor")
    ]
    names = [
        ("generate", len(kw["input_ids"]) if isinstance(kw["input_ids"][0], list) else 1)
        if kind == "generate"
        else (kind, tuple(kw) if kind in ("release", "resume") else len(kw["names"]))
        for kind, kw in calls
    ]
    weights = len(list(controller.engine.named_weights()))  # the torch broadcast sends every name
    if sync == "ipc":  # the ipc sync into SGLang a tied weight under its first name only
        weights -= len(tied_aliases(controller.engine.named_weights()))
    rows = cfg.data.batch_size * cfg.data.samples_per_prompt

    def one_step(step: int) -> list[tuple[str, Any]]:
        return [
            ("generate", rows),  # ROLLOUT: the step's rows, with everything resident
            ("release", RELEASED_TAGS),  # leaving ROLLOUT
            ("resume", SYNC_TAGS),  # SYNC: weights back before the broadcast
            ("update", weights),  # the broadcast into them: the weights of this step
            ("resume", CACHE_TAGS),  # SYNC done: KV cache and CUDA graphs back for the next rollout
        ]

    evaluation = [("generate", EVAL_SIZE)] * 2  # one request per route, chain and legs
    assert names == [
        ("generate", 1),  # the readiness probe: SGLang's generating /health
        ("update", weights),  # the initial weights (step 0)
        *evaluation,  # the start evaluation, after the initial sync
        *[call for step in range(1, STEPS + 1) for call in one_step(step)],
        *evaluation,  # the end evaluation, after the last sync: the engine generates after its resume
    ]
    assert engine.released == set()  # the run ends with everything resident
    if sync == "ipc":  # every TP worker holds the actor's last weights, bit for bit
        final = dict(controller.engine.named_weights())
        tied = tied_aliases(final.items())  # SGLang's model ties these itself: sent under the first name
        for worker in engine.loaded:
            assert worker.keys() == final.keys() - tied.keys()
            assert all(torch.equal(worker[n], final[n].detach()) for n in worker)
    assert controller.rollout_memory.active
    assert (
        controller.rollout_memory.calls
        == [
            ("release", RELEASED_TAGS),
            ("resume", SYNC_TAGS),
            ("resume", CACHE_TAGS),
        ]
        * STEPS
    )
    kinds = [(t.source, t.target) for t in controller.transitions]
    assert kinds == [
        (Phase.ROLLOUT, Phase.TRAIN), (Phase.TRAIN, Phase.SYNC), (Phase.SYNC, Phase.ROLLOUT)
    ] * STEPS  # fmt: skip
    lines = read_metrics(run_dir / "metrics.jsonl")
    assert [line["rollout/weight_version"] for line in lines] == [0.0, 1.0, 2.0]
    assert all(line["train/response_tokens"] == rows * 2 for line in lines)  # every rollout answered
    record = json.loads((run_dir / "eval.json").read_text())
    assert record["student_weights"] == {"start": "0", "end": str(STEPS)}


@pytest.mark.parametrize(
    ("backend", "mode", "active"),
    [("sglang", "colocated", True), ("sglang", "separated", False), ("hf", "colocated", False)],
)
def test_which_engines_move(backend: str, mode: str, active: bool) -> None:
    """Only a colocated sglang engine is moved; otherwise every call is a no-op (no request is sent)."""

    class Refuses:
        async def release(self, tags):
            raise AssertionError("no release expected")

        async def resume_memory(self, tags):
            raise AssertionError("no resume expected")

    memory = RolloutMemory.from_config(SimpleNamespace(rollout=SimpleNamespace(backend=backend, mode=mode)))
    assert memory.active is active
    if not active:
        asyncio.run(memory.release([Refuses()]))
        asyncio.run(memory.resume_weights([Refuses()]))
        asyncio.run(memory.resume_cache([Refuses()]))
        assert memory.calls == []
