"""The rollout role with `rollout.backend: sglang` (roles/rollout_sglang.py), wired to a stand-in with
sglang.Engine's Python API, its methods' signatures as SGLang 0.5.17 defines them (srt/entrypoints/engine.py;
SGLang itself runs on the GPU machines only).

Real parts: the role's aiohttp server on 127.0.0.1 behind the job's token, its readiness probe and endpoint
record, the trainer's rollout-phase client, and the trainer's torch weight sync (a real gloo group) into an
engine of tensor-parallel size 2 whose two stand-in TP workers each join the group as their own rank and
receive every tensor, as SGLang's TP workers do.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from helpers_auth import TOKEN, write_run_dir_token
from helpers_ports import free_ports
from test_sglang_backend import sglang_item

from mopd_hpc.config import RunConfig
from mopd_hpc.config.rollout import SamplingConfig
from mopd_hpc.engines.rollout.client import RolloutClient
from mopd_hpc.engines.rollout.sglang_backend import SGLangBackendError, SGLangLaunch
from mopd_hpc.engines.weight_sync.torch import BroadcastGroup, TensorSpec, receive_tensors
from mopd_hpc.records.run_dir import endpoint_file
from mopd_hpc.roles.env import RoleEnv
from mopd_hpc.roles.rollout_sglang import run_sglang
from mopd_hpc.trainer.rollout_phase import generate
from mopd_hpc.trainer.weight_sync import SyncSettings, TorchSync

REPO = Path(__file__).resolve().parents[2]
TP = 2


class TPStandIn:
    """sglang.Engine's Python API with `tp_size` workers, SGLang 0.5.17's signatures: generation answers in
    SGLang's shapes (output ids 5, 6 with log-probs −0.5, −0.75, meta_info.weight_version "default": 0.5.17's
    Engine methods never set it); each worker thread joins the weight-update group as rank_offset + tp_rank and receives the
    broadcast tensors (SGLang's `init_weights_update_group` and `update_weights_from_distributed` semantics,
    algo_awex.md §3.2)."""

    def __init__(self, launch: SGLangLaunch, healthy: bool = True) -> None:
        self.launch, self.healthy = launch, healthy
        self.thread = threading.get_ident()  # SGLang's Engine: every call from the thread that built it
        self.calls: list[tuple[str, Any]] = []
        self.groups: list[BroadcastGroup] = []
        self.received: list[dict[str, torch.Tensor]] = []
        self.shut = False

    def on_its_thread(self) -> None:
        assert threading.get_ident() == self.thread, "an Engine call off the thread that built it"

    def generate(self, **kw: Any) -> Any:
        self.on_its_thread()
        self.calls.append(("generate", kw))
        if not self.healthy:
            return []
        ids = kw["input_ids"]
        rows = ids if ids and isinstance(ids[0], list) else [ids]
        items = [sglang_item(r, [5, 6], [-0.5, -0.75]) for r in rows]
        return items if isinstance(ids[0], list) else items[0]

    def _on_workers(self, work: Any) -> list[Any]:
        out: list[Any] = [None] * self.launch.tp_size
        errors: list[BaseException] = []

        def one(rank: int) -> None:
            try:
                out[rank] = work(rank)
            except BaseException as exc:  # noqa: BLE001 — re-raised below, in the caller's thread
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(r,)) for r in range(self.launch.tp_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return out

    def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
        backend: str = "nccl",
    ) -> tuple[bool, str]:  # fmt: skip
        kw = dict(master_address=master_address, master_port=master_port, rank_offset=rank_offset,
                  world_size=world_size, group_name=group_name, backend=backend)  # fmt: skip
        self.on_its_thread()
        self.calls.append(("init_group", kw))
        self.groups = self._on_workers(
            lambda r: BroadcastGroup.join(
                kw["master_address"],
                kw["master_port"],
                kw["rank_offset"] + r,
                kw["world_size"],
                kw["group_name"],
                kw["backend"],
                timeout_s=60,
            )
        )
        return True, "joined"

    def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]],
        group_name: str = "weight_update_group", flush_cache: bool = True, load_format: str | None = None,
    ) -> tuple[bool, str]:  # fmt: skip
        kw = dict(names=names, dtypes=dtypes, shapes=shapes, group_name=group_name, flush_cache=flush_cache,
                  load_format=load_format)  # fmt: skip
        self.on_its_thread()
        self.calls.append(("update", kw))
        specs = [
            TensorSpec(n, d, tuple(s))
            for n, d, s in zip(kw["names"], kw["dtypes"], kw["shapes"], strict=True)
        ]
        self.received = self._on_workers(
            lambda r: receive_tensors(self.groups[r], specs, kw.get("load_format"))
        )
        return True, "updated"

    def destroy_weights_update_group(self, group_name: str) -> tuple[bool, str]:
        self.on_its_thread()
        self.calls.append(("destroy", group_name))
        for g in self.groups:
            g.close()
        return True, ""

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.on_its_thread()
        self.calls.append(("release", tags))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.on_its_thread()
        self.calls.append(("resume", tags))

    def flush_cache(self) -> None:
        self.on_its_thread()
        self.calls.append(("flush", None))

    def shutdown(self) -> None:
        self.on_its_thread()
        self.shut = True


def sglang_config(awex: bool = False) -> RunConfig:
    """configs/local_gpu_colocated.yaml with the sglang backend at TP 2 on a 2-GPU node (the stand-in needs
    no GPU: only the config's validation counts GPUs)."""
    doc = yaml.safe_load((REPO / "configs" / "local_gpu_colocated.yaml").read_text())
    doc["rollout"]["backend"] = "sglang"
    doc["rollout"].setdefault("engines", {})["tensor_parallel"] = TP
    for group in doc["cluster"].values():
        if isinstance(group, dict) and "gpus_per_node" in group:
            group["gpus_per_node"] = TP
    doc["weight_sync"] = {"backend": "awex" if awex else "torch"}
    return RunConfig.from_dict(doc)


def role_env(run_dir: Path, ports: list[int]) -> RoleEnv:
    http, nccl, dist_init = ports
    return RoleEnv.from_env(
        {
            "MOPD_RUN_DIR": str(run_dir),
            "MOPD_ROLE": "rollout",
            "MOPD_INDEX": "0",
            "MOPD_JOB_ID": "local-7",
            "MOPD_HOST": "localhost",
            "MOPD_NODE_ADDR": "127.0.0.1",
            "MOPD_BACKEND": "local",
            "MOPD_PORT_HTTP": str(http),
            "MOPD_PORT_NCCL": str(nccl),
            "MOPD_PORT_DIST_INIT": str(dist_init),
        }
    )


async def wait_record(path: Path, task: asyncio.Task[None]) -> dict[str, Any]:
    for _ in range(300):
        if path.exists():
            return json.loads(path.read_text())
        if task.done():
            task.result()
        await asyncio.sleep(0.05)
    raise AssertionError(f"{path} was never written")


async def start_role(
    role: RoleEnv, cfg: RunConfig, make: Any
) -> tuple[asyncio.Task[None], asyncio.Event, dict[str, Any], Any]:
    """`run_sglang` for `role` with the stand-in `make(launch)` builds, until its endpoint record is written:
    (the role's task, its stop event, the record, the stand-in)."""
    engines: list[Any] = []

    def factory(launch: SGLangLaunch) -> Any:
        engines.append(make(launch))
        return engines[-1]

    stop = asyncio.Event()
    task = asyncio.create_task(run_sglang(role, cfg, {}, factory, stop))
    record = await wait_record(endpoint_file(role.run_dir, "rollout", str(role.index)), task)
    (engine,) = engines
    return task, stop, record, engine


class Actor:
    """The trainer engine's `named_weights()` for TorchSync."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.weights = {
            "model.embed_tokens.weight": torch.randn(7, 4, generator=gen),
            "model.norm.weight": torch.rand(4, generator=gen),
            "lm_head.weight": torch.randn(7, 4, generator=gen).to(torch.bfloat16),
        }

    def named_weights(self) -> Any:
        return iter(self.weights.items())


def test_sglang_role_serves_rollouts_and_weight_sync_to_a_tp2_engine(tmp_path: Path) -> None:
    write_run_dir_token(tmp_path)
    ports = free_ports(4)
    role, cfg = role_env(tmp_path, ports[:3]), sglang_config()

    async def scenario() -> None:
        task, stop, record, engine = await start_role(role, cfg, TPStandIn)
        # the launch from the named leases and the config; readiness = SGLang's generating /health probe
        assert (engine.launch.port, engine.launch.nccl_port, engine.launch.dist_init_port) == tuple(ports[:3])
        assert engine.launch.tp_size == TP and engine.launch.model_path == cfg.models.actor.path
        # decode CUDA graphs up to the step's rows of this (only) engine
        rows = cfg.data.batch_size * cfg.data.samples_per_prompt
        assert engine.launch.engine_kwargs()["cuda_graph_max_bs_decode"] == rows
        assert engine.calls[0] == ("generate", {"input_ids": [0], "sampling_params": {"max_new_tokens": 1}})
        assert record == record | {
            "url": f"http://127.0.0.1:{ports[0]}",
            "port": ports[0],
            "job_id": "local-7",
            "backend": "sglang",
            "index": 0,
        }
        async with RolloutClient(record["url"], token=TOKEN, retries=0) as client:
            sampling = SamplingConfig(max_new_tokens=2, temperature=0.7)
            samples = await generate([client], [[1, 2, 3], [4]], sampling, n=2, seeds=[10, 20])
            assert [s.output_ids for s in samples] == [(5, 6)] * 4
            assert [s.behavior_logprobs for s in samples] == [(-0.5, -0.75)] * 4
            assert [s.prompt_ids for s in samples] == [(1, 2, 3), (1, 2, 3), (4,), (4,)]
            kw = engine.calls[-1][1]  # n copies per prompt, prompt-major, seeds + j
            assert [p["sampling_seed"] for p in kw["sampling_params"]] == [10, 11, 20, 21]
            assert all(p["temperature"] == 0.7 and p["max_new_tokens"] == 2 for p in kw["sampling_params"])

            actor = Actor()
            sync = TorchSync(actor, SyncSettings("127.0.0.1", ports[3], "gloo"), 60, ranks_per_server=TP)
            await sync.start([client])
            await sync.push(1, [client])
            init = next(kw for name, kw in engine.calls if name == "init_group")
            assert (init["rank_offset"], init["world_size"]) == (1, 1 + TP)
            for worker in engine.received:  # both TP workers hold every tensor, bit for bit
                assert worker.keys() == actor.weights.keys()
                for name, value in actor.weights.items():
                    assert torch.equal(worker[name], value) and worker[name].dtype == value.dtype
            assert (await client.model_info())["weight_version"] == "1"
            (again,) = await generate([client], [[4]], sampling, n=1, seeds=[1])
            assert again.weight_version == "1"  # the server's: SGLang 0.5.17 answers "default"
            await sync.close([client])
        stop.set()
        await task
        assert engine.shut and not endpoint_file(tmp_path, "rollout", "0").exists()

    asyncio.run(scenario())


def test_awex_instance_is_ready_by_model_info_not_a_generation(tmp_path: Path) -> None:
    """An AWEX-launched engine starts with its weights released: the generating probe fails, and the role
    publishes once /model_info answers."""
    write_run_dir_token(tmp_path)
    ports = free_ports(3)
    role, cfg = role_env(tmp_path, ports), sglang_config(awex=True)

    async def scenario() -> None:
        task, stop, record, engine = await start_role(
            role, cfg, lambda launch: TPStandIn(launch, healthy=False)
        )
        assert record["backend"] == "sglang" and engine.launch.awex
        assert engine.calls == []  # never probed with a generation
        stop.set()
        await task

    asyncio.run(scenario())


def test_environment_that_breaks_mu_is_refused_before_the_engine_starts(tmp_path: Path) -> None:
    write_run_dir_token(tmp_path)
    role, cfg = role_env(tmp_path, free_ports(3)), sglang_config()
    started: list[SGLangLaunch] = []
    with pytest.raises(SGLangBackendError, match="temperature-1 log-probs"):
        asyncio.run(run_sglang(role, cfg, {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}, started.append))
    assert started == [] and not endpoint_file(tmp_path, "rollout", "0").exists()


class EngineStarted(Exception):
    """Raised by the stand-in sglang.Engine once it has seen its environment."""


@pytest.mark.parametrize(("alloc", "refused"), [(None, False), ("max_split_size_mb:256", False),
                                                ("expandable_segments:True", True)])  # fmt: skip
def test_the_engine_starts_without_expandable_segments(tmp_path: Path, monkeypatch, alloc, refused) -> None:
    """The role's entry point (`roles/rollout.py` main) with sglang: the environment the in-process Engine
    starts in (and its scheduler processes inherit) has no expandable segments, so torch_memory_saver stays
    on; the user's own expandable segments are refused before the Engine starts, naming the variable."""
    import os
    import sys
    import types

    from mopd_hpc.roles import rollout as rollout_main

    if alloc is None:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    else:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", alloc)
    write_run_dir_token(tmp_path)
    role, cfg = role_env(tmp_path, free_ports(3)), sglang_config()
    seen: dict[str, Any] = {}

    def engine(**kw: Any) -> None:  # sglang.Engine: reads the process environment as it starts
        seen.update(alloc=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), saver=kw["enable_memory_saver"])
        raise EngineStarted

    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=engine))
    monkeypatch.setattr(rollout_main, "start_server_role", lambda environ: (role, cfg))
    if refused:
        with pytest.raises(SGLangBackendError, match="PYTORCH_CUDA_ALLOC_CONF='expandable_segments:True'"):
            rollout_main.main([])
        assert seen == {}
        return
    with pytest.raises(EngineStarted):
        rollout_main.main([])
    assert seen == {"alloc": alloc, "saver": True}
    # the hf backend keeps its expandable segments (its KV cache grows per decode step)
    assert rollout_main.allocator_env({}, "hf") == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
