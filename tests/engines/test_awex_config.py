"""AWEX configuration from the job plan and its 0.9.0 gaps (the transfer plans: tests/engines/test_awex_plan.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from helpers_scripts import run_report

from mopd_hpc.config import RunConfig
from mopd_hpc.engines.weight_sync.awex import (
    META_SERVER_FILE,
    AwexConfigError,
    AwexJobConfig,
    AwexUnavailableError,
    drives_reader,
    patch_colocate_writer,
    read_meta_server_address,
    require_awex,
    write_meta_server_address,
)
from mopd_hpc.plan.placement import place_children
from mopd_hpc.runtime.plan import JobPlan

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "qwen3_8gpu_colocated.yaml"


def _plan(**cluster_rollout: object) -> JobPlan:
    data = yaml.safe_load(CONFIG.read_text())
    if cluster_rollout:
        data["rollout"].update(cluster_rollout.get("rollout", {}))
        data["weight_sync"] = cluster_rollout.get("weight_sync", data["weight_sync"])
        data["models"]["actor"].update(cluster_rollout.get("actor", {}))
        data["models"]["teachers"][0].update(cluster_rollout.get("actor", {}))
    return place_children(RunConfig.from_dict(data))


def test_colocate_config_from_the_8gpu_plan(tmp_path: Path) -> None:
    write_meta_server_address(tmp_path, "10.0.0.7", 41234)
    assert json.loads((tmp_path / META_SERVER_FILE).read_text()) == {"host": "10.0.0.7", "port": 41234}
    cfg = AwexJobConfig.from_plan(_plan()).with_meta_server(read_meta_server_address(tmp_path))
    assert (cfg.mode, cfg.num_engines, cfg.engine_tp, cfg.infer_world, cfg.train_world) == (
        "colocate",
        8,
        1,
        8,
        8,
    )
    assert cfg.trainer_config() == {
        "meta_server_addr": "10.0.0.7:41234",
        "comm_backend": "nccl",
        "enable_colocate_mode": True,
        "weights_exchange_ipc_backend": "cuda",
        "enable_debug_mode": False,
        "weights_validation_steps": 0,
        "disable_weights_exchange_pipeline": False,
    }
    inf = cfg.inference_config(engine_rank=5)
    assert inf["engine_rank"] == 5 and inf["num_engines"] == 8 and inf["tp_size"] == 1
    assert inf["node_rank"] == 0 and inf["nnodes"] == 1 and inf["enable_memory_saver"] is True
    assert cfg.transfer_rank("rollout", 5) == 5 and cfg.transfer_rank("actor", 3) == 11
    assert cfg.trainer_env(3, "10.0.0.7", 3) == {"AWEX_MASTER_ADDR": "10.0.0.7", "DEVICE": "3"}


def test_separate_mode_and_bad_inputs(tmp_path: Path) -> None:
    plan = _plan(rollout={"backend": "sglang", "mode": "separated", "engines": {"count": 2, "tensor_parallel": 2}}, weight_sync={"backend": "awex"}, actor={"tensor_parallel": 4})  # fmt: skip
    cfg = AwexJobConfig.from_plan(plan, meta_server_addr="h:1")
    assert (cfg.mode, cfg.infer_world, cfg.train_world, cfg.engine_tp) == ("separate", 4, 4, 2)
    assert cfg.transfer_rank("rollout", 1, rank_in_engine=1) == 3 and cfg.transfer_rank("actor", 0) == 4
    with pytest.raises(AwexConfigError, match="not registered in awex 0.9.0"):
        AwexJobConfig.from_plan(plan, model_arch="LlamaForCausalLM")
    with pytest.raises(AwexConfigError, match="meta_server_addr is empty"):
        AwexJobConfig.from_plan(plan).trainer_config()
    with pytest.raises(AwexConfigError, match="expected 'host:port'"):
        cfg.with_meta_server("nohost")
    with pytest.raises(AwexConfigError, match="does not exist after 0"):
        read_meta_server_address(tmp_path)
    (tmp_path / META_SERVER_FILE).write_text("{}")
    with pytest.raises(AwexConfigError, match="malformed"):
        read_meta_server_address(tmp_path)


def test_plan_transfer_ranks_must_follow_awex_numbering() -> None:
    plan = _plan()
    rollout0 = next(c for c in plan.children if c.role == "rollout" and c.index == 0)
    broken = SimpleNamespace(
        name=plan.name,
        mode=plan.mode,
        by_role=lambda role: tuple(
            SimpleNamespace(**{**_fields(c), "transfer_ranks": (3,)}) if c is rollout0 else c
            for c in plan.by_role(role)
        ),
    )
    with pytest.raises(AwexConfigError, match=r"rollout\[0\].*transfer_ranks=\(3,\), AWEX expects \(0,\)"):
        AwexJobConfig.from_plan(broken)


def _fields(child: object) -> dict:
    out = {name: getattr(child, name) for name in child.__slots__}
    out["env_dict"] = child.env_dict
    out["label"] = child.label
    return out


# ------------------------------------------------------------------------------------- 0.9.0 gaps


def test_gap1_import_awex_needs_megatron_core() -> None:
    def no_megatron(name: str) -> object | None:
        return None if name.startswith("megatron") else object()

    with pytest.raises(AwexUnavailableError, match="imports megatron.core.*also in rollout processes"):
        require_awex(find_spec=no_megatron)
    with pytest.raises(AwexUnavailableError, match="awex extra is not installed"):
        require_awex(find_spec=lambda name: None)
    require_awex(find_spec=lambda name: object())


def test_gap2_node_rank_is_always_set() -> None:
    assert drives_reader(0) is True and drives_reader(1) is False
    cfg = AwexJobConfig.from_plan(_plan(), meta_server_addr="h:1")
    assert cfg.inference_config(2, node_rank=1, nnodes=2)["node_rank"] == 1
    with pytest.raises(AwexConfigError, match="node_rank in"):
        cfg.inference_config(0, node_rank=2, nnodes=2)
    pytest.importorskip("awex", reason="awex (the awex extra) is not installed")
    from awex import InferenceConfig

    assert InferenceConfig().node_rank is None  # the gap: SGLangEngine.initialize() would skip its reader
    inf = InferenceConfig.from_dict(cfg.inference_config(7))
    inf.validate()
    assert inf.node_rank == 0 and inf.engine_rank == 7 and inf.num_engines == 8 and inf.enable_colocate_mode


def test_gap3_colocate_writer_gets_its_train_config() -> None:
    writer = SimpleNamespace()
    assert patch_colocate_writer(writer, "cpu").asystem_train_config == {
        "weights_exchange_ipc_backend": "cpu"
    }
    patch_colocate_writer(writer, "cuda")  # idempotent: an existing config is kept
    assert writer.asystem_train_config == {"weights_exchange_ipc_backend": "cpu"}
    with pytest.raises(AwexConfigError, match="ipc_backend='shm'"):
        patch_colocate_writer(SimpleNamespace(), "shm")
    pytest.importorskip("awex", reason="awex (the awex extra) is not installed")
    import inspect

    from awex import NCCLWeightsWriter

    source = inspect.getsource(NCCLWeightsWriter._init_writer_in_colocate_mode)
    assert "self.asystem_train_config" in source  # the attribute awex reads and never sets
    real = object.__new__(NCCLWeightsWriter)
    assert not hasattr(real, "asystem_train_config")
    assert patch_colocate_writer(real).asystem_train_config["weights_exchange_ipc_backend"] == "cuda"


class _DefaultGroup:
    def __init__(self, bound: object) -> None:
        self.bound_device_id = bound


def test_awex_groups_are_not_split_from_a_bound_default_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gap 7: while awex builds its custom group, the default group's bound device is cleared (torch would
    otherwise ncclCommSplit the trainer's own world), and restored after, also when the build fails."""
    pytest.importorskip("awex", reason="awex is not installed")
    pytest.importorskip("megatron.core", reason="megatron-core (the megatron extra) is not installed")
    import awex.util.process_group as process_group
    import torch.distributed as dist

    from mopd_hpc.engines.weight_sync.awex import _unsplit, unsplit_custom_groups

    unsplit_custom_groups()
    unsplit_custom_groups()  # idempotent
    wrapped = process_group.init_custom_process_group
    assert wrapped._mopd_unsplit and not getattr(wrapped.__wrapped__, "_mopd_unsplit", False)

    default = _DefaultGroup("cuda:0")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_group", lambda: default)
    seen = []

    def build(*args, **kwargs):
        seen.append((default.bound_device_id, args, kwargs))
        if kwargs.get("fail"):
            raise RuntimeError("rendezvous failed")
        return "group"

    make = _unsplit(build)
    assert make("nccl", world_size=2) == "group"
    with pytest.raises(RuntimeError, match="rendezvous failed"):
        make(fail=True)
    assert [bound for bound, _, _ in seen] == [None, None]
    assert seen[0][1:] == (("nccl",), {"world_size": 2})
    assert default.bound_device_id == "cuda:0"  # restored, after success and after failure
    unbound = _DefaultGroup(None)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_group", lambda: unbound)
    assert make() == "group" and unbound.bound_device_id is None


_POLLING = """
import json, sys, threading, time
from awex.meta.meta_server import MetaServerClient, start_meta_server, stop_meta_server
from mopd_hpc.engines.weight_sync.awex_latency import fast_meta_server_polling

if __name__ == "__main__":
    fast_meta_server_polling()
    fast_meta_server_polling()  # idempotent
    host, port = start_meta_server("127.0.0.1", 0)
    client, report = MetaServerClient(host, port), {}
    later = lambda s, fn: threading.Timer(s, fn).start()
    later(0.2, lambda: client.put_object("k", {"v": 1}))
    report["get_after_put"] = client.get_object("k", timeout=10)  # get_object waits through wait_key
    later(0.1, lambda: client.add_object_to_set("s", 1))
    later(0.2, lambda: client.add_object_to_set("s", 2))
    client.wait_set_until_size("s", 2, timeout=10, delete_after_wait=True)
    report["set_deleted_after_wait"] = not client.has_key("s")
    for name, call in (("key", lambda: client.wait_key("missing", 0.2)),
                       ("set", lambda: client.wait_set_until_size("empty", 1, 0.2))):
        t0 = time.monotonic()
        try:
            call()
        except TimeoutError as exc:
            report[f"{name}_timeout"] = [str(exc), round(time.monotonic() - t0, 2)]
    stop_meta_server()
    print(json.dumps(report))
"""


def test_fast_polling_keeps_awex_wait_semantics(tmp_path: Path) -> None:
    """Gap 8: the faster waits return when the key/set appears, delete a waited set when asked, and time out
    with awex's own messages, against a real MetaServer process."""
    pytest.importorskip("awex", reason="awex is not installed")
    pytest.importorskip("megatron.core", reason="megatron-core (the megatron extra) is not installed")
    report = run_report(tmp_path, _POLLING, timeout_s=120, name="polling.py")
    assert report["get_after_put"] == {"v": 1}
    assert report["set_deleted_after_wait"] is True
    assert report["key_timeout"][0] == "Timeout waiting for key 'missing'"
    assert report["set_timeout"][0] == "Timeout waiting for set empty to reach size 1"
    assert report["key_timeout"][1] >= 0.2 and report["set_timeout"][1] >= 0.2
