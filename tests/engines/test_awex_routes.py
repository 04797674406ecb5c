"""The rollout server's AWEX endpoints (issue 8) on a real 127.0.0.1 aiohttp server serving a real micro
Qwen3, through the real `RolloutClient`; the awex engine is a fake built by an injected factory (the real
reader runs in tests/engines/test_awex_hf_gpu.py). Plus the rollout role's AWEX_MASTER_ADDR at its edge.

The fake's update copies the weights of a second micro checkpoint into the served parameters in place (as
awex's reader does) and sets weight_version = str(step) (as awex_hf does); the oracle of "generate still
works after an update" is greedy decoding by a second engine loaded from that checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import web
from helpers_auth import TOKEN
from helpers_models import save_micro_qwen3

from mopd_hpc.engines.rollout.client import RolloutClient, RolloutServerError
from mopd_hpc.engines.rollout.hf_engine import HFRolloutEngine
from mopd_hpc.engines.rollout.hf_server import ServerArgs, rollout_app
from mopd_hpc.engines.rollout.http_app import RolloutServer
from mopd_hpc.engines.rollout.protocol import SamplingParams
from mopd_hpc.engines.weight_sync.awex import AwexConfigError, AwexJobConfig, AwexUnavailableError

REPO = Path(__file__).resolve().parents[2]
PROMPT = [3, 17, 5, 9]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
JOB = AwexJobConfig(
    mode="colocate", comm_backend="nccl", ipc_backend="cuda", meta_server_addr="127.0.0.1:4567", num_engines=2,
    engine_tp=1, engine_pp=1, infer_world=2, train_world=2, model_arch="Qwen3ForCausalLM",
)  # fmt: skip
CONFIG = JOB.inference_config(1)


class FakeAwexEngine:
    """awex's inference-engine surface the routes call; records the calls in order."""

    def __init__(self, config: Mapping[str, Any], engine: HFRolloutEngine, factory: FakeFactory) -> None:
        self.config, self.engine, self.factory = dict(config), engine, factory
        self.calls: list[tuple[str, Any]] = []
        self.global_step = -1
        self.started, self.updating = threading.Event(), threading.Event()

    def initialize(self) -> None:
        self.calls.append(("initialize", None))
        self.started.set()
        if self.factory.init_release is not None:  # awex's initialize() waits for the first publish
            assert self.factory.init_release.wait(30), "the test never released the init"
        if self.factory.init_error is not None:
            raise self.factory.init_error

    def set_global_step(self, step: int) -> None:
        self.calls.append(("set_global_step", step))
        self.global_step = step

    def update_weights(self) -> None:
        self.calls.append(("update_weights", self.global_step))
        self.updating.set()
        if self.factory.release is not None:
            assert self.factory.release.wait(30), "the test never released the update"
        if self.factory.update_error is not None:
            raise self.factory.update_error
        state = dict(self.engine.model.named_parameters())
        with self.engine.lock, torch.no_grad():
            for name, tensor in self.factory.new_weights.items():
                if name in state:
                    state[name].copy_(tensor)
        self.engine.weight_version = str(self.global_step)


class FakeFactory:
    """The injected factory: builds FakeAwexEngines; `error` raised by the factory itself (as hf_awex_engine
    raises AwexConfigError / AwexUnavailableError before building anything)."""

    def __init__(self, new_weights: Mapping[str, torch.Tensor]) -> None:
        self.new_weights = new_weights
        self.built: list[FakeAwexEngine] = []
        self.error: BaseException | None = None
        self.init_error: BaseException | None = None
        self.update_error: BaseException | None = None
        self.release: threading.Event | None = None
        self.init_release: threading.Event | None = None

    def __call__(self, config: Mapping[str, Any], engine: HFRolloutEngine) -> FakeAwexEngine:
        if self.error is not None:
            raise self.error
        self.built.append(FakeAwexEngine(config, engine, self))
        return self.built[-1]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("awex_routes")
    served = save_micro_qwen3(root / "served", seed=0, initializer_range=0.2)
    return served, save_micro_qwen3(
        root / "published", seed=1, initializer_range=0.2
    )  # greedy outputs differ


@pytest.fixture(scope="module")
def published(checkpoints: tuple[Path, Path]) -> HFRolloutEngine:
    """The oracle: an engine loaded from the checkpoint the fake writer 'publishes'."""
    return HFRolloutEngine.load(str(checkpoints[1]), "cpu", "float32")


@pytest.fixture
def engine(checkpoints: tuple[Path, Path]) -> HFRolloutEngine:
    return HFRolloutEngine.load(str(checkpoints[0]), "cpu", "float32")


@pytest.fixture
def factory(published: HFRolloutEngine) -> FakeFactory:
    return FakeFactory({k: v.detach().clone() for k, v in published.model.named_parameters()})


@contextlib.asynccontextmanager
async def serving(engine: HFRolloutEngine, factory: FakeFactory) -> AsyncIterator[RolloutClient]:
    """The hf server's app (`rollout_app`: SGLang surface + AWEX routes) on 127.0.0.1, any port."""
    server = RolloutServer(ServerArgs(model_path=engine.model_path, host="127.0.0.1", port=0), engine)
    server.scheduler.start()
    runner = web.AppRunner(rollout_app(server, TOKEN, awex_factory=factory), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        async with RolloutClient(url, token=TOKEN, timeout_s=60) as client:
            yield client
    finally:
        await runner.cleanup()
        server.scheduler.stop()


async def greedy(client: RolloutClient) -> tuple[list[int], str]:
    (sample,) = await client.generate([PROMPT], GREEDY)
    raw = await client.generate_raw({"input_ids": PROMPT, "sampling_params": GREEDY.to_json()})
    assert raw["output_ids"] == list(sample.output_ids)
    return list(sample.output_ids), raw["meta_info"]["weight_version"]


def oracle_greedy(engine: HFRolloutEngine) -> list[int]:
    """Greedy continuation of PROMPT by a direct forward pass per token (no server)."""
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(GREEDY.max_new_tokens):
            ids.append(int(engine.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT) :]


def server_error(excinfo: pytest.ExceptionInfo[RolloutServerError]) -> tuple[int, str]:
    return excinfo.value.status, excinfo.value.message


def test_init_ok_then_already_then_409_on_another_config(engine, factory) -> None:
    async def body() -> None:
        async with serving(engine, factory) as client:
            assert await client.awex_init(CONFIG) == {"status": "ok", "engine_rank": 1}
            assert len(factory.built) == 1
            built = factory.built[0]
            assert built.config == CONFIG and built.engine is engine and built.calls == [("initialize", None)]
            again = await client.awex_init(dict(CONFIG))
            assert again == {"status": "ok", "engine_rank": 1, "already": True}
            other = JOB.with_meta_server("127.0.0.1:9999").inference_config(0)
            with pytest.raises(RolloutServerError) as excinfo:
                await client.awex_init(other)
            status, message = server_error(excinfo)
            assert status == 409
            assert "differing keys ['engine_rank', 'meta_server_addr']" in message
            assert "127.0.0.1:9999" in message
            assert len(factory.built) == 1 and built.calls == [("initialize", None)]  # nothing rebuilt

    asyncio.run(body())


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (
            AwexConfigError("HF engine AWEX config {'tp_size': 2}: the HF engine is one process, expected 1"),
            400,
        ),
        (AwexUnavailableError("cannot use weight_sync.backend 'awex': awex is missing; install it"), 503),
    ],
)
def test_init_maps_awex_errors(engine, factory, error: Exception, status: int) -> None:
    factory.error = error

    async def body() -> None:
        async with serving(engine, factory) as client:
            with pytest.raises(RolloutServerError) as excinfo:
                await client.awex_init(CONFIG)
            assert server_error(excinfo) == (status, str(error))
            with pytest.raises(RolloutServerError) as excinfo:  # nothing was initialized
                await client.awex_update(1)
            assert excinfo.value.status == 409

    asyncio.run(body())


def test_an_init_while_one_runs_is_409_and_update_waits_for_init(engine, factory) -> None:
    factory.init_release = threading.Event()

    async def body() -> None:
        async with serving(engine, factory) as client:
            first = asyncio.create_task(client.awex_init(CONFIG))
            assert await asyncio.to_thread(lambda: _built(factory).started.wait(30))
            with pytest.raises(RolloutServerError) as excinfo:
                await client.awex_init(CONFIG)
            status, message = server_error(excinfo)
            assert status == 409 and "another /awex/init is still running" in message
            with pytest.raises(RolloutServerError) as excinfo:  # not initialized until initialize() returns
                await client.awex_update(0)
            assert excinfo.value.status == 409 and "POST /awex/init first" in excinfo.value.message
            factory.init_release.set()
            assert await first == {"status": "ok", "engine_rank": 1}
            assert (await client.awex_init(CONFIG))["already"] is True
            assert (await client.awex_update(0))["weight_version"] == "0"
            assert len(factory.built) == 1

    asyncio.run(body())


def _built(factory: FakeFactory) -> FakeAwexEngine:
    """The first built fake, once the factory built it (the init runs in the server's worker thread)."""
    for _ in range(3000):
        if factory.built:
            return factory.built[0]
        threading.Event().wait(0.01)
    raise AssertionError("the factory was never called")


def test_init_failure_500_names_type_and_init_can_be_retried(engine, factory) -> None:
    factory.init_error = ConnectionRefusedError("MetaServer 127.0.0.1:4567 refused")

    async def body() -> None:
        async with serving(engine, factory) as client:
            with pytest.raises(RolloutServerError) as excinfo:
                await client.awex_init(CONFIG)
            assert server_error(excinfo) == (500, "ConnectionRefusedError: MetaServer 127.0.0.1:4567 refused")
            factory.init_error = None
            assert await client.awex_init(CONFIG) == {"status": "ok", "engine_rank": 1}
            assert len(factory.built) == 2

    asyncio.run(body())


def test_update_before_init_is_409(engine, factory) -> None:
    async def body() -> None:
        async with serving(engine, factory) as client:
            with pytest.raises(RolloutServerError) as excinfo:
                await client.awex_update(3)
            status, message = server_error(excinfo)
            assert status == 409 and "step=3" in message and "POST /awex/init first" in message
            assert factory.built == [] and engine.weight_version == "default"

    asyncio.run(body())


def test_update_sets_step_then_updates_and_generate_serves_the_new_weights(
    engine, factory, published
) -> None:
    async def body() -> None:
        async with serving(engine, factory) as client:
            before, version = await greedy(client)
            assert (before, version) == (oracle_greedy(engine), "default")
            await client.awex_init(CONFIG)
            out = await client.awex_update(7)
            assert out["status"] == "ok" and out["weight_version"] == "7"
            assert isinstance(out["seconds"], float) and out["seconds"] >= 0.0
            assert factory.built[0].calls == [
                ("initialize", None),
                ("set_global_step", 7),
                ("update_weights", 7),
            ]
            after, version = await greedy(client)
            assert version == "7" and (await client.model_info())["weight_version"] == "7"
            assert after == oracle_greedy(published) and after != before
            out = await client.awex_update(8)
            assert out["weight_version"] == "8" and factory.built[0].calls[-2:] == [
                ("set_global_step", 8),
                ("update_weights", 8),
            ]

    asyncio.run(body())


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"step": -1}, "step=-1: expected an integer >= 0"),
        ({"step": "x"}, "step='x': expected an integer"),
        ({"step": True}, "step=True: expected an integer"),
        ({}, "step=None: expected an integer"),
        ({"step": 1, "stpe": 2}, "unsupported field(s) ['stpe']"),
    ],
)
def test_bad_step_is_400_naming_step(engine, factory, body: dict, expected: str) -> None:
    async def run() -> None:
        async with serving(engine, factory) as client:
            await client.awex_init(CONFIG)
            with pytest.raises(RolloutServerError) as excinfo:
                await client.request("POST", "/awex/update_weights", body)
            status, message = server_error(excinfo)
            assert status == 400 and expected in message
            assert factory.built[0].calls == [("initialize", None)]  # no update started

    asyncio.run(run())


def test_bad_init_body_is_400_naming_inference_config(engine, factory) -> None:
    async def body() -> None:
        async with serving(engine, factory) as client:
            for bad, expected in (
                ({}, "inference_config=None: expected a non-empty JSON object"),
                ({"inference_config": [1]}, "inference_config=[1]: expected a non-empty JSON object"),
                ({"inference_config": CONFIG, "x": 1}, "unsupported field(s) ['x']"),
            ):
                with pytest.raises(RolloutServerError) as excinfo:
                    await client.request("POST", "/awex/init", bad)
                status, message = server_error(excinfo)
                assert status == 400 and expected in message
            assert factory.built == []

    asyncio.run(body())


def test_a_second_update_while_one_runs_is_409_and_a_failed_update_frees_the_slot(engine, factory) -> None:
    factory.release = threading.Event()

    async def body() -> None:
        async with serving(engine, factory) as client:
            await client.awex_init(CONFIG)
            first = asyncio.create_task(client.awex_update(1))
            assert await asyncio.to_thread(factory.built[0].updating.wait, 30)
            with pytest.raises(RolloutServerError) as excinfo:
                await client.awex_update(2)
            status, message = server_error(excinfo)
            assert status == 409 and "the update of step 1 is still running" in message
            factory.release.set()
            assert (await first)["weight_version"] == "1"
            factory.update_error = RuntimeError("NCCL recv timed out")
            with pytest.raises(RolloutServerError) as excinfo:
                await client.awex_update(2)
            assert server_error(excinfo) == (500, "RuntimeError: NCCL recv timed out")
            factory.update_error = None
            assert (await client.awex_update(2))["weight_version"] == "2"
            assert [c for c in factory.built[0].calls if c[0] == "set_global_step"] == [
                ("set_global_step", 1),
                ("set_global_step", 2),
                ("set_global_step", 2),
            ]

    asyncio.run(body())


def test_awex_update_waits_past_the_clients_shorter_timeout(engine, factory) -> None:
    """The update blocks until the writer publishes: its timeout is at least AWEX_UPDATE_TIMEOUT_S."""
    factory.release = threading.Event()

    async def body() -> None:
        async with serving(engine, factory) as client:
            await client.awex_init(CONFIG)
            short = RolloutClient(client.base_url, token=TOKEN, timeout_s=0.3)
            try:
                update = asyncio.create_task(short.awex_update(4))
                assert await asyncio.to_thread(factory.built[0].updating.wait, 30)
                await asyncio.sleep(0.9)  # three times the client's own timeout
                assert not update.done()
                factory.release.set()
                assert (await update)["weight_version"] == "4"
            finally:
                await short.close()

    asyncio.run(body())


def test_the_server_imports_no_awex_until_init() -> None:
    code = (
        "import sys, mopd_hpc.engines.rollout.hf_server, mopd_hpc.roles.rollout;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('awex', 'megatron')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ---- the rollout role's edge: AWEX_MASTER_ADDR ----------------------------------------------------------


def _role(tmp_path: Path, backend: str, host: str):
    from mopd_hpc.roles.env import RoleEnv

    return RoleEnv(tmp_path, "rollout", 0, "job-1", host, backend, ports={"http": 12345})


def _config(backend: str):
    from mopd_hpc.config import RunConfig
    from mopd_hpc.config.rollout import WeightSyncConfig

    cfg = RunConfig.from_yaml(REPO / "configs" / "local_cpu.yaml")
    return cfg.model_copy(update={"weight_sync": WeightSyncConfig(backend=backend)})


def test_awex_env_is_the_nodes_address_only_for_awex(tmp_path: Path) -> None:
    from mopd_hpc.roles.rollout import awex_env

    assert awex_env(_role(tmp_path, "local", "node-a"), _config("torch")) == {}
    assert awex_env(_role(tmp_path, "local", "node-a"), _config("awex")) == {"AWEX_MASTER_ADDR": "127.0.0.1"}
    # on a cluster: the node's address as the actor resolves it (a literal address resolves to itself)
    assert awex_env(_role(tmp_path, "slurm", "127.0.0.2"), _config("awex")) == {
        "AWEX_MASTER_ADDR": "127.0.0.2"
    }


@pytest.mark.parametrize(("backend", "expected"), [("awex", "127.0.0.1"), ("torch", "left alone")])
def test_main_sets_awex_master_addr_in_its_environment(
    tmp_path: Path, monkeypatch, backend, expected
) -> None:
    from mopd_hpc.roles import rollout as rollout_main

    monkeypatch.setenv("AWEX_MASTER_ADDR", "left alone")  # restored after the test
    role, cfg = _role(tmp_path, "local", "node-a"), _config(backend)
    seen: dict[str, Any] = {}

    async def fake_run(got_role, args) -> None:  # the server would start here: awex reads the env then
        seen.update(role=got_role, port=args.port, addr=os.environ.get("AWEX_MASTER_ADDR"))

    monkeypatch.setattr(rollout_main, "start_server_role", lambda environ: (role, cfg))
    monkeypatch.setattr(rollout_main, "run", fake_run)
    assert rollout_main.main([]) == 0
    assert seen == {"role": role, "port": 12345, "addr": expected}
