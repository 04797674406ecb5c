"""The controller's weight sync (trainer/weight_sync.py, issue 8): `build_sync` picks TorchSync or AwexSync from
weight_sync.backend; `awex_job_config` derives the AWEX settings from the run config; `AwexSync` against a
stand-in publisher and stand-in rollout clients (awex itself needs a GPU and a MetaServer; the real flow is
tests/engines/test_awex_hf_gpu.py): start order (MetaServer address written before any /awex/init), push runs the
actor's publish and every server's update at the same time (each side waits for the other), and a failure on
either side surfaces naming the step.
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from helpers_configs import set_dotted

from mopd_hpc.config import RunConfig
from mopd_hpc.engines.rollout.client import RolloutServerError
from mopd_hpc.engines.weight_sync.awex import (
    META_SERVER_FILE,
    AwexConfigError,
    AwexJobConfig,
    read_meta_server_address,
    write_meta_server_address,
)
from mopd_hpc.engines.weight_sync.torch import WeightSyncError
from mopd_hpc.trainer import weight_sync
from mopd_hpc.trainer.awex_job import awex_job_config
from mopd_hpc.trainer.weight_sync import (
    AwexSync,
    AwexSyncError,
    SyncSettings,
    TorchSync,
    build_sync,
)

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 20.0  # a side waiting for the other gives up after this (a sequential push fails, never hangs)


def actor_dir(tmp_path: Path, architecture: str | None = "Qwen3ForCausalLM") -> Path:
    path = tmp_path / "student"
    path.mkdir(exist_ok=True)
    config = {"model_type": "qwen3"} | ({"architectures": [architecture]} if architecture else {})
    (path / "config.json").write_text(json.dumps(config))
    return path


def one_gpu_config(tmp_path: Path, **changes: Any) -> RunConfig:
    """configs/qwen3_8gpu_colocated.yaml cut to one GPU: megatron actor TP 1, one HF rollout engine, AWEX
    colocate; `changes` are dotted keys."""
    data = yaml.safe_load((REPO / "configs" / "qwen3_8gpu_colocated.yaml").read_text())
    data["models"]["actor"].update(tensor_parallel=1, path=str(actor_dir(tmp_path)))
    data["models"]["teachers"][0]["tensor_parallel"] = 1
    data["rollout"].update(backend="hf", engines={"count": 1, "tensor_parallel": 1})
    data["cluster"]["group"]["gpus_per_node"] = 1
    set_dotted(data, changes)
    return RunConfig.from_dict(data)


def cpu_config() -> RunConfig:
    return RunConfig.from_dict(yaml.safe_load((REPO / "configs" / "local_cpu.yaml").read_text()))


SETTINGS = SyncSettings("127.0.0.1", 45555, "gloo")


def in_loop(test: Any) -> Any:
    """Run an async test body in a fresh event loop (`asyncio.run`), keeping its fixtures."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> Any:
        return asyncio.run(test(*args, **kwargs))

    return run


# --- build_sync / awex_job_config ----------------------------------------------------------------------


def test_build_sync_picks_torch_for_backend_torch(tmp_path: Path) -> None:
    engine = object()
    sync = build_sync(cpu_config(), engine, SETTINGS, tmp_path)
    assert isinstance(sync, TorchSync)
    assert (sync.engine, sync.settings, sync.sender) == (engine, SETTINGS, None)


def test_build_sync_picks_awex_with_the_jobs_settings(tmp_path: Path) -> None:
    engine = object()
    sync = build_sync(one_gpu_config(tmp_path), engine, SETTINGS, tmp_path / "run")
    assert isinstance(sync, AwexSync)
    assert (sync.engine, sync.run_dir, sync.host) == (engine, tmp_path / "run", "127.0.0.1")
    assert sync.config == AwexJobConfig(
        mode="colocate", comm_backend="nccl", ipc_backend="cuda", meta_server_addr="", num_engines=1,
        engine_tp=1, engine_pp=1, infer_world=1, train_world=1, model_arch="Qwen3ForCausalLM",
    )  # fmt: skip


def test_awex_job_config_mode_follows_rollout_mode(tmp_path: Path) -> None:
    cfg = one_gpu_config(
        tmp_path,
        **{"rollout.mode": "separated", "rollout.engines": {"count": 2, "tensor_parallel": 1}},
        **{"cluster.group.gpus_per_node": 3, "weight_sync.awex_mode": None},
    )
    got = awex_job_config(cfg)
    assert (got.mode, got.num_engines, got.infer_world, got.train_world) == ("separate", 2, 2, 1)
    assert got.with_meta_server("10.0.0.1:4321").inference_config(1)["engine_rank"] == 1


def test_awex_job_config_errors(tmp_path: Path) -> None:
    cfg = one_gpu_config(tmp_path)
    with pytest.raises(
        AwexConfigError, match=r"architecture 'LlamaForCausalLM' is not registered in awex 0\.9\.0"
    ):
        awex_job_config(cfg, model_arch="LlamaForCausalLM")
    actor_dir(tmp_path, architecture=None)
    with pytest.raises(AwexConfigError, match=r"config\.json: no 'architectures' entry"):
        awex_job_config(cfg)
    (tmp_path / "student" / "config.json").unlink()
    with pytest.raises(AwexConfigError, match=r"config\.json: .*AWEX needs the actor's architectures\[0\]"):
        awex_job_config(cfg)
    # colocate pairs one trainer rank with one rollout rank: two engines cannot be served (the config rules
    # refuse it too; model_copy skips them to reach this check)
    engines = cfg.rollout.engines.model_copy(update={"count": 2})
    two = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"engines": engines})})
    with pytest.raises(
        AwexConfigError,
        match=r"count·tensor_parallel = 2·1: AWEX colocate .* actor's 1 trainer rank.* expected 1",
    ):
        awex_job_config(two, model_arch="Qwen3ForCausalLM")


def test_awex_job_config_counts_every_rank_of_a_tp_actor(tmp_path: Path) -> None:
    """Colocated on 2 GPUs: a TP 2 actor (2 trainer ranks) and 2 HF engines, each trainer rank a writer at
    transfer rank infer_world + rank with its own AWEX environment."""
    cfg = one_gpu_config(
        tmp_path,
        **{"cluster.group.gpus_per_node": 2, "models.actor.tensor_parallel": 2},
        **{"rollout.engines": {"count": 2, "tensor_parallel": 1}},
    )
    got = awex_job_config(cfg)
    assert (got.mode, got.num_engines, got.infer_world, got.train_world) == ("colocate", 2, 2, 2)
    assert [got.transfer_rank("actor", r) for r in range(2)] == [2, 3]
    assert got.trainer_env(1, "10.0.0.2", 1) == {"AWEX_MASTER_ADDR": "10.0.0.2", "DEVICE": "1"}


@in_loop
async def test_the_controller_announces_a_sync_every_rank_writes(tmp_path: Path) -> None:
    """An AWEX sync from a 2-rank actor is written by every rank: the controller sends the followers a
    `weights` record before it (trainer/rank_writer.py); a one-rank AWEX sync, and a torch sync at TP 1, none."""
    from mopd_hpc.trainer.controller import Controller

    sent: list[tuple[str, int, str]] = []

    async def publish(record: Any) -> None:
        sent.append((record.kind, record.step, record.reason))

    two = awex_job_config(
        one_gpu_config(
            tmp_path,
            **{"cluster.group.gpus_per_node": 2, "models.actor.tensor_parallel": 2},
            **{"rollout.engines": {"count": 2, "tensor_parallel": 1}},
        )
    )
    one = awex_job_config(one_gpu_config(tmp_path))
    engine = SimpleNamespace(gathers_over_tp=False)
    for sync, want in (
        (AwexSync(two, engine, tmp_path, "127.0.0.1"), [("weights", 4, "sync")]),
        (AwexSync(one, engine, tmp_path, "127.0.0.1"), []),
        (TorchSync(engine, SETTINGS), []),
    ):
        controller = object.__new__(Controller)
        controller.engine, controller.sync = engine, sync
        controller.group = SimpleNamespace(publish=publish)
        sent.clear()
        await controller._announce_gather(4, "sync")
        await controller._announce_gather(4, "evaluate")  # an evaluation gathers nothing at TP 1
        assert sent == want, sync


@in_loop
async def test_torch_sync_push_before_start_names_the_step() -> None:
    with pytest.raises(WeightSyncError, match=r"^step 4: push before start"):
        await TorchSync(object(), SETTINGS).push(4, [])


# --- AwexSync with stand-ins ------------------------------------------------------------------------------


class Recorder:
    """Shared event log of the stand-ins."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.lock = threading.Lock()

    def add(self, *event: Any) -> None:
        with self.lock:
            self.events.append(event)


class FakePublisher:
    """AwexActorPublisher's surface; `publish` runs `on_publish(step)` (in the sync's thread)."""

    on_publish: Any = None

    def __init__(self, cfg: AwexJobConfig, actor: Any) -> None:
        self.cfg, self.actor = cfg, actor
        self.recorder: Recorder = actor.recorder
        self.recorder.add("publisher", cfg.meta_server_addr)

    def initialize(self) -> None:
        self.recorder.add("initialize", threading.current_thread() is threading.main_thread())

    def publish(self, step: int) -> float:
        self.recorder.add("publish", step)
        if FakePublisher.on_publish is not None:
            FakePublisher.on_publish(step)
        return 0.25


class FakeClient:
    """RolloutClient's AWEX surface; `awex_update` awaits `on_update(step)` when set."""

    def __init__(self, i: int, recorder: Recorder, run_dir: Path) -> None:
        self.base_url, self.recorder, self.run_dir = f"http://127.0.0.1:{30000 + i}", recorder, run_dir
        self.on_update: Any = None
        self.init_error: Exception | None = None

    async def awex_init(self, inference_config: dict[str, Any]) -> dict[str, Any]:
        # the MetaServer address is in the run dir before any server is asked to build its reader
        address = read_meta_server_address(self.run_dir)
        self.recorder.add("awex_init", self.base_url, address, dict(inference_config))
        if self.init_error is not None:
            raise self.init_error
        return {"status": "ok", "engine_rank": inference_config["engine_rank"]}

    async def awex_update(self, step: int) -> dict[str, Any]:
        self.recorder.add("awex_update", self.base_url, step)
        if self.on_update is not None:
            await self.on_update(step)
        return {"status": "ok", "weight_version": str(step), "seconds": 0.1}


@pytest.fixture
def awex_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """An AwexSync (separate-mode settings, 2 engines) over stand-ins; returns (sync, clients, recorder)."""
    recorder = Recorder()
    stopped: list[bool] = []

    def fake_start(run_dir: Path, host: str) -> str:
        recorder.add("meta_server", str(run_dir), host)
        write_meta_server_address(run_dir, host, 4321)
        return f"{host}:4321"

    monkeypatch.setattr(weight_sync, "start_run_meta_server", fake_start)
    monkeypatch.setattr(weight_sync, "stop_run_meta_server", lambda: stopped.append(True))
    monkeypatch.setattr(weight_sync, "AwexActorPublisher", FakePublisher)
    monkeypatch.setattr(FakePublisher, "on_publish", None)
    config = AwexJobConfig(
        mode="separate", comm_backend="nccl", ipc_backend="cuda", meta_server_addr="", num_engines=2,
        engine_tp=1, engine_pp=1, infer_world=2, train_world=1, model_arch="Qwen3ForCausalLM",
    )  # fmt: skip
    engine = SimpleNamespace(recorder=recorder, device=SimpleNamespace(type="cpu"))
    sync = AwexSync(config, engine, tmp_path, "127.0.0.1")
    clients = [FakeClient(i, recorder, tmp_path) for i in range(2)]
    return sync, clients, recorder, stopped


@in_loop
async def test_awex_start_order_meta_server_writer_then_readers(awex_env, tmp_path: Path) -> None:
    sync, clients, recorder, stopped = awex_env
    await sync.start(clients)
    addr = "127.0.0.1:4321"
    want_cfg = sync.config.with_meta_server(addr)
    assert recorder.events == [
        ("meta_server", str(tmp_path), "127.0.0.1"),
        ("publisher", addr),
        ("initialize", False),  # in a worker thread: the event loop stays free
        ("awex_init", clients[0].base_url, addr, want_cfg.inference_config(0)),
        ("awex_init", clients[1].base_url, addr, want_cfg.inference_config(1)),
    ]
    assert json.loads((tmp_path / META_SERVER_FILE).read_text()) == {"host": "127.0.0.1", "port": 4321}
    assert sync.address == addr
    await sync.close(clients)
    await sync.close(clients)  # once only
    assert stopped == [True]


@in_loop
async def test_awex_start_refuses_a_client_count_and_names_a_failed_init(awex_env) -> None:
    sync, clients, recorder, _ = awex_env
    with pytest.raises(AwexConfigError, match=r"^1 rollout clients for rollout.engines.count = 2"):
        await sync.start(clients[:1])
    assert recorder.events == []  # nothing started
    clients[1].init_error = RolloutServerError("POST", "http://x/awex/init", 400, "bad config")
    with pytest.raises(
        AwexSyncError,
        match=r"^AWEX start: rollout engine 1 \(http://127.0.0.1:30001\) /awex/init failed: "
        r"RolloutServerError: POST http://x/awex/init -> 400: bad config",
    ):
        await sync.start(clients)


@in_loop
async def test_awex_push_before_start(awex_env) -> None:
    sync, clients, _, stopped = awex_env
    with pytest.raises(AwexSyncError, match=r"^AWEX sync of step 0: push before start"):
        await sync.push(0, clients)
    await sync.close(clients)
    assert stopped == []


@in_loop
async def test_awex_push_publish_waits_for_the_updates(awex_env) -> None:
    """The publish (thread) returns only after both servers' updates began: sequential would time out."""
    sync, clients, recorder, _ = awex_env
    await sync.start(clients)
    updating = [threading.Event(), threading.Event()]

    def on_publish(step: int) -> None:
        for ev in updating:
            assert ev.wait(WAIT_S), "the publish ran without the servers' updates"

    def started(i: int):
        async def on_update(step: int) -> None:
            updating[i].set()

        return on_update

    FakePublisher.on_publish = on_publish
    for i, c in enumerate(clients):
        c.on_update = started(i)
    await sync.push(3, clients)
    pushed = [e for e in recorder.events if e[0] in ("publish", "awex_update")]
    assert sorted(pushed) == sorted(
        [("publish", 3), ("awex_update", clients[0].base_url, 3), ("awex_update", clients[1].base_url, 3)]
    )


@in_loop
async def test_awex_push_updates_wait_for_the_publish(awex_env) -> None:
    """The reverse: each server's update returns only after the publish ran."""
    sync, clients, _, _ = awex_env
    await sync.start(clients)
    published = threading.Event()
    FakePublisher.on_publish = lambda step: published.set()

    async def on_update(step: int) -> None:
        for _ in range(int(WAIT_S / 0.01)):
            if published.is_set():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the update ran without the publish")

    for c in clients:
        c.on_update = on_update
    await sync.push(5, clients)
    assert published.is_set()


@in_loop
async def test_awex_push_publish_error_names_the_step(awex_env) -> None:
    sync, clients, _, _ = awex_env
    await sync.start(clients)

    def boom(step: int) -> None:
        raise RuntimeError(f"writer lost step {step}")

    FakePublisher.on_publish = boom
    with pytest.raises(
        AwexSyncError,
        match=r"^AWEX sync of step 7: the actor's publish failed: RuntimeError: writer lost step 7$",
    ) as info:
        await sync.push(7, clients)
    assert isinstance(info.value.__cause__, RuntimeError)


@in_loop
async def test_awex_push_update_error_surfaces_while_the_publish_still_waits(awex_env) -> None:
    """A server's failure propagates at once, though the publish (blocked on that server) never returns."""
    sync, clients, _, _ = awex_env
    await sync.start(clients)
    release = threading.Event()
    FakePublisher.on_publish = lambda step: release.wait(WAIT_S)

    async def refuse(step: int) -> None:
        raise RolloutServerError("POST", "http://127.0.0.1:30001/awex/update_weights", 409, "init first")

    clients[1].on_update = refuse
    try:
        with pytest.raises(
            AwexSyncError,
            match=r"^AWEX sync of step 2: rollout engine 1 \(http://127.0.0.1:30001\) /awex/update_weights "
            r"failed: RolloutServerError: .* -> 409: init first$",
        ):
            await sync.push(2, clients)
        assert not release.is_set()  # the error did not wait for the publish
    finally:
        release.set()
