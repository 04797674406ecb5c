"""CPU parts of AWEX through the HF rollout engine (issue 8): the "hf" engine registration, the inference-side
parameter metadata `awex_hf` gives awex's resolver, the local-spec name fix of the trainer side, and a full
metadata match + awex transfer plan between a real megatron-core GPTModel and the HF engine, replayed on CPU
tensors (the NCCL transfer itself runs in tests/engines/test_awex_hf_gpu.py)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import helpers_fork
import pytest
import torch

pytest.importorskip("awex", reason="awex is not installed")
pytest.importorskip("megatron.core", reason="megatron-core (the megatron extra) is not installed")

from helpers_models import save_micro_moe, save_micro_qwen3  # noqa: E402

from mopd_hpc.engines.rollout.hf_engine import HFRolloutEngine  # noqa: E402
from mopd_hpc.engines.weight_sync.awex import AwexConfigError  # noqa: E402
from mopd_hpc.engines.weight_sync.awex_actor import local_spec_name  # noqa: E402
from mopd_hpc.engines.weight_sync.awex_hf import (  # noqa: E402
    ENGINE_NAME,
    HFToHFWeightConverter,
    hf_awex_engine,
    register_hf_engine,
)

REPO = Path(__file__).resolve().parents[2]
CONFIG = {"tp_size": 1, "pp_size": 1, "dp_size": 1, "nnodes": 1, "node_rank": 0, "num_engines": 1,
          "engine_rank": 0, "meta_server_addr": "127.0.0.1:1", "comm_backend": "nccl"}  # fmt: skip


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> HFRolloutEngine:
    path = save_micro_qwen3(tmp_path_factory.mktemp("awex_hf") / "ckpt", seed=0)
    return HFRolloutEngine.load(str(path), "cpu", "float32")


def test_registration_resolves_hf_and_keeps_other_engines() -> None:
    register_hf_engine()
    register_hf_engine()  # idempotent: no double wrapping
    import awex.meta.infer_meta_resolver as resolver
    import awex.reader.weights_reader as reader
    from awex.sharding.sglang_sharding import get_sglang_rank_info

    assert resolver.get_rank_info_extractor("sglang") is get_sglang_rank_info
    assert resolver.get_rank_info_extractor(ENGINE_NAME).__name__ == "hf_rank_info"
    assert reader.get_rank_info_extractor.__wrapped__.__name__ == "get_rank_info_extractor"
    with pytest.raises(ValueError, match="Unknown engine_name"):
        resolver.get_rank_info_extractor("nope")


def test_inference_metadata_is_the_hf_state_dict(engine: HFRolloutEngine) -> None:
    from awex.meta.infer_meta_resolver import InferParamMetaResolver
    from awex.sharding.param_sharding import ShardingType

    awex_engine = hf_awex_engine(CONFIG, engine)
    metas = InferParamMetaResolver(awex_engine, convert_params=True).get_parameters_meta()
    state = engine.model.state_dict()
    assert sorted(m.name for m in metas) == sorted(state)  # incl. the tied lm_head alias awex adds
    for meta in metas:
        assert meta.global_shape == tuple(state[meta.name].shape) and meta.dtype == torch.float32
        assert len(meta.shards) == 1 and meta.shards[0].sharding_type == ShardingType.NO_SHARDING
    calls = awex_engine.execute_task_in_model_worker(lambda model, model_context, k: (model, k), k=3)
    assert calls == [(engine.model, 3)]


def test_config_errors(engine: HFRolloutEngine) -> None:
    with pytest.raises(AwexConfigError, match="node_rank is None"):
        hf_awex_engine(CONFIG | {"node_rank": None}, engine)
    with pytest.raises(AwexConfigError, match="tp_size"):
        hf_awex_engine(CONFIG | {"tp_size": 2}, engine)
    with pytest.raises(AwexConfigError, match="before initialize"):
        hf_awex_engine(CONFIG, engine).update_weights()


def test_local_spec_name() -> None:
    assert local_spec_name("decoder.layers.3.input_layernorm.weight") == (
        "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"
    )
    assert (
        local_spec_name("decoder.layers.3.pre_mlp_layernorm.weight")
        == "decoder.layers.3.pre_mlp_layernorm.weight"
    )


_PLAN_SCRIPT = textwrap.dedent(
    """
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(1, 1)
    import awex.util.device as device_util
    device_util.device_count = lambda: 1  # a CPU host: awex takes the local rank modulo the GPU count
    from types import SimpleNamespace
    from mopd_hpc.engines.megatron.convert import Qwen3Shape, hf_to_mcore
    from mopd_hpc.engines.megatron.build import read_hf_checkpoint
    from mopd_hpc.engines.megatron.model import build_gpt_model, load_mcore_state
    from mopd_hpc.engines.rollout.hf_engine import HFRolloutEngine
    from mopd_hpc.engines.weight_sync.awex_actor import pretrained_config, register_local_spec_names
    from mopd_hpc.engines.weight_sync.awex_hf import HFToHFWeightConverter, hf_awex_engine
    from mopd_hpc.engines.megatron.convert_moe import split_fused_experts
    register_local_spec_names()
    import awex.models.registry as registry
    from awex.meta.infer_meta_resolver import InferParamMetaResolver
    from awex.meta.train_meta_resolver import McoreParamMetaResolver
    from awex.transfer.transfer_plan import TransferPlanBuilder
    from awex.util.common import check_train_infer_params_meta, simple_hf_config
    ckpt = sys.argv[1]
    config, hf = read_hf_checkpoint(ckpt)
    shape = Qwen3Shape.from_hf_config(config)
    model = build_gpt_model(shape, dtype="float32", cpu_init=True)
    load_mcore_state(model, hf_to_mcore(hf, shape))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))  # the actor moved away from the checkpoint
    engine = HFRolloutEngine.load(ckpt, "cpu", "float32")
    awex_engine = hf_awex_engine(json.loads(sys.argv[3]), engine)
    infer = InferParamMetaResolver(awex_engine, convert_params=True).get_parameters_meta()
    infer_conf = {"engine_name": "hf", "infer_atten_tp_size": 1, "infer_engine_config": awex_engine.config,
                  "hf_config": simple_hf_config(awex_engine.hf_config), "infer_world_size": 1,
                  "expected_pp_ranks": [0], "device_backend": "cpu",
                  "router_dtype": getattr(awex_engine.hf_config, "router_dtype", "bf16")}  # as awex's reader
    hf_cfg = pretrained_config(config)
    trainer = SimpleNamespace(model=[model], engine_name="mcore", enable_debug_mode=False)
    resolver = McoreParamMetaResolver(trainer, hf_cfg, infer_conf)
    train = resolver.get_parameters_meta()
    check_train_infer_params_meta(train, infer, raise_exception=True)
    conv = registry.get_train_weights_converter("mcore", config["architectures"][0], hf_cfg, resolver._rank_info,
                                                infer_conf, tf_config=model.config)
    sent = {hn: hp for n, p in model.named_parameters() for hn, hp in conv.convert_param(n, p.detach())}
    sent.setdefault("lm_head.weight", sent["model.embed_tokens.weight"])
    to_hf = HFToHFWeightConverter(None, None, None)  # the reader's receive targets (expert views)
    params = {hn: hp for n, p in engine.model.named_parameters() for hn, hp in to_hf.convert_param(n, p)}
    params.setdefault("lm_head.weight", params["model.embed_tokens.weight"])
    ops = TransferPlanBuilder(1, 1, 1).build_weights_mapping_operations(infer, train)
    with torch.no_grad():
        for op in ops:  # replay what the NCCL reader does: recv into the HF parameter slices
            name = op.recv_shard_meta.name
            params[name][op.inf_slices].copy_(sent[name][op.train_slices])
    from mopd_hpc.engines.megatron.convert import mcore_to_hf
    want = mcore_to_hf({k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}, shape)
    got = split_fused_experts(engine.model.state_dict())
    print(json.dumps({"ops": len(ops), "names": len(train), "train_dtypes": sorted({str(m.dtype) for m in train}),
                      "equal": all(torch.equal(got[k], want[k]) for k in want), "keys": sorted(want),
                      "extra_keys": sorted(set(got) - set(want)), "missing_keys": sorted(set(want) - set(got)),
                      "router_dtype": getattr(awex_engine.hf_config, "router_dtype", None)}))
    """
)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_trainer_and_hf_metadata_match_and_the_plan_replays_exactly(tmp_path: Path, family: str) -> None:
    """A real (CPU) megatron GPTModel's AWEX metadata matches the HF engine's; awex's plan, replayed on
    CPU, makes every HF parameter equal the actor's (converted to HF names) bitwise. qwen3_moe: a Qwen3-MoE
    (2 layers of 4 experts, untied, float32): awex's mcore converter sends each expert under its checkpoint name
    and the HF engine's converter receives them into the fused experts' rows (issue 33); the router arrives in
    float32 (the engine's router_dtype), not rounded to awex's default bf16."""
    if family == "qwen3":
        ckpt = save_micro_qwen3(tmp_path / "ckpt", seed=1)
    else:
        ckpt = save_micro_moe(tmp_path / "ckpt", seed=1)
    proc = helpers_fork.run(
        ["-c", _PLAN_SCRIPT, str(ckpt), str(tmp_path / "pg"), json.dumps(CONFIG)],
        capture_output=True, text=True, timeout=240, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["train_dtypes"] == ["torch.float32"]
    assert "model.layers.0.input_layernorm.weight" in report["keys"]
    assert report["equal"] is True and report["missing_keys"] == []
    if family == "qwen3":
        assert report["names"] == 14 and report["ops"] == 14  # 13 weights + the tied lm_head alias
        assert report["router_dtype"] is None and report["extra_keys"] == ["lm_head.weight"]  # tied
        return
    # 3 (embeddings, final norm, lm_head) + 2 layers × (8 attention/norm tensors + router + 4 experts × 3)
    assert report["names"] == 45 and report["ops"] == 45
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in report["keys"]
    assert report["router_dtype"] == "fp32" and report["extra_keys"] == []


def test_expert_receive_targets_follow_the_parameters_storage(tmp_path: Path) -> None:
    """The HF engine's converter gives each fused expert tensor as per-expert views; after the parameters get
    new storage (offload/onload: module.to()), the next task in the model worker rebuilds awex's worker reader's
    targets, so a receive writes the served model's current fused rows."""
    from awex.reader.weights_reader import WorkerWeightsReader

    engine = HFRolloutEngine.load(str(save_micro_moe(tmp_path / "moe", seed=2)), "cpu", "float32")
    awex_engine = hf_awex_engine(CONFIG, engine)
    assert awex_engine.fused_experts and engine.model.config.router_dtype == "fp32"
    reader = object.__new__(WorkerWeightsReader)  # what initialize() reads of awex's worker reader
    reader.model, reader.hf_config, reader.rank_info = engine.model, engine.model.config, None
    reader.weight_converter = HFToHFWeightConverter(None, None, None)
    WorkerWeightsReader.initialize(reader)
    awex_engine.model_context["scheduler"].awes_weights_reader = reader
    experts = engine.model.model.layers[1].mlp.experts
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    assert reader.parameters[name].shape == (16, 32)  # f_e × h
    with torch.no_grad():
        for p in engine.model.parameters():  # what module.to() does to each parameter
            p.data = p.data.clone()
    stale = reader.parameters[name]
    assert stale.untyped_storage().data_ptr() != experts.gate_up_proj.untyped_storage().data_ptr()
    awex_engine.execute_task_in_model_worker(lambda model, model_context: None)
    with torch.no_grad():
        reader.parameters[name].copy_(torch.full((16, 32), 7.0))  # what the NCCL receive does
    assert torch.equal(experts.gate_up_proj[2, 16:], torch.full((16, 32), 7.0))
    assert not torch.equal(experts.gate_up_proj[2, :16], torch.full((16, 32), 7.0))  # the gate rows stay
    assert reader.parameters["model.layers.1.mlp.gate.weight"] is engine.model.model.layers[1].mlp.gate.weight


class _Reader:
    """The attributes awex's NCCLWorkerWeightsReader handshake reads."""

    def __init__(self, colocate: bool, world_size: int) -> None:
        self.enable_colocate_mode, self.world_size, self.calls = colocate, world_size, 0


def test_colocate_reader_of_one_rank_skips_the_self_handshake() -> None:
    """Gap 6: with one rollout rank in colocate mode the handshake would NCCL-receive from itself."""
    from awex.reader.nccl_reader import NCCLWorkerWeightsReader

    from mopd_hpc.engines.weight_sync.awex_hf import _skip_self_handshake

    register_hf_engine()
    register_hf_engine()
    installed = NCCLWorkerWeightsReader._shake_hands_with_writer
    assert installed._mopd_hf and not getattr(installed.__wrapped__, "_mopd_hf", False)  # wrapped once
    calls: list[_Reader] = []
    shake = _skip_self_handshake(calls.append)
    alone, pair, separate = _Reader(True, 1), _Reader(True, 2), _Reader(False, 1)
    for reader in (alone, pair, separate):
        shake(reader)
    assert calls == [pair, separate]


def test_colocate_writer_never_frees_parameter_storage() -> None:
    """Gap 5: awex's colocate writer resizes the storage of every converted tensor to 0; views of a
    protected model's parameters (one flat buffer, as with Megatron DDP) must survive it."""
    from mopd_hpc.engines.weight_sync.awex_actor import protect_parameter_storage

    flat = torch.arange(12, dtype=torch.float32)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(flat[:8].view(2, 4))  # parameters as views into one buffer
    model.b = torch.nn.Parameter(flat[8:])
    protect_parameter_storage(model)
    protect_parameter_storage(model)  # idempotent
    import awex.writer.nccl_writer as nccl_writer

    converted = [model.w.detach(), model.w.detach()[1], model.b.detach()]  # identity and sliced conversions
    own_copy = torch.ones(5)
    nccl_writer.release_tensors([*converted, own_copy])
    assert flat.untyped_storage().size() == 12 * 4 and torch.equal(flat, torch.arange(12.0))
    assert own_copy.untyped_storage().size() == 0  # awex's own grouped copies are still freed
    nccl_writer.release_tensors(torch.zeros(3))  # a single tensor, as awex also calls it


def test_awex_memory_tags_map_to_residency_parts() -> None:
    from mopd_hpc.engines.weight_sync.awex_actor import residency_parts

    assert residency_parts(None) == ("optimizer", "weights")
    assert residency_parts("weights") == ("weights",)  # awex passes a bare string once
    assert residency_parts(["optimizer"]) == ("optimizer",)
    assert residency_parts(["weights", "optimizer"]) == ("optimizer", "weights")
    assert residency_parts(["kv_cache"]) == ()  # not the actor's memory
