"""HF ⇄ megatron-core conversion of Qwen3-MoE (router and experts, MoE and dense layers mixed) and Llama (no q/k
norms) micro models built with transformers: bitwise round trips, the expert layout, tensor-parallel shards,
and the names and shapes of a real megatron-core GPTModel built with MoE layers on CPU (a subprocess)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from test_megatron_convert import _GPT_SCRIPT, _bitwise_equal, megatron_report
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from mopd_hpc.engines.megatron.convert import (
    ConversionError,
    Qwen3Shape,
    gather_tp,
    hf_to_mcore,
    mcore_to_hf,
    shard_tp,
    tp_split_dim,
)
from mopd_hpc.engines.megatron.convert_moe import fuse_experts, split_fused_experts


def _distinct_norms(model: torch.nn.Module) -> None:
    with torch.no_grad():  # norms start at 1, the router at 0: make them distinguishable
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("mlp.gate.weight"):
                p.uniform_(0.5, 1.5)


def micro_moe(tie: bool, dtype: torch.dtype = torch.float32, mlp_only_layers=(1,)) -> Qwen3MoeForCausalLM:
    """3 layers (layer 1 dense unless `mlp_only_layers` says otherwise), 4 experts of f_e 24, top 2."""
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=120, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=3, mlp_only_layers=list(mlp_only_layers), num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=tie,
    )  # fmt: skip
    model = Qwen3MoeForCausalLM(cfg).to(dtype)
    _distinct_norms(model)
    return model


def micro_llama(tie: bool, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(1)
    cfg = LlamaConfig(
        vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=tie,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).to(dtype)
    _distinct_norms(model)
    return model


def _hf(model: torch.nn.Module, tie: bool) -> dict[str, torch.Tensor]:
    """The checkpoint-layout state dict (experts one by one), without a tied lm_head."""
    sd = {k: v for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
    return split_fused_experts(sd)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_round_trip_is_bitwise(tie: bool, dtype: torch.dtype) -> None:
    model = micro_moe(tie, dtype)
    shape = Qwen3Shape.from_hf_config(model.config, padded_vocab_size=128)
    assert shape.moe_layers == (0, 2) and (shape.num_experts, shape.moe_router_topk) == (4, 2)
    assert shape.moe_ffn_hidden_size == 24 and shape.qk_layernorm and shape.norm_topk_prob is False
    hf = _hf(model, tie)
    mc = hf_to_mcore(hf, shape)
    assert mc["decoder.layers.0.mlp.router.weight"].shape == (4, 64)
    assert mc["decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight"].shape == (48, 64)
    assert mc["decoder.layers.2.mlp.experts.local_experts.3.linear_fc2.weight"].shape == (64, 24)
    assert mc["decoder.layers.1.mlp.linear_fc1.weight"].shape == (192, 64)  # the dense layer
    assert not any(k.startswith("decoder.layers.1.mlp.router") for k in mc)
    back = mcore_to_hf(mc, shape)
    _bitwise_equal(back, hf)
    # the in-memory transformers 5 layout back from the checkpoint names
    memory = {k: v for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
    _bitwise_equal(fuse_experts(back), memory)


def test_expert_layout_is_gate_then_up_per_expert() -> None:
    model = micro_moe(tie=False)
    sd = model.state_dict()
    mc = hf_to_mcore(_hf(model, False), Qwen3Shape.from_hf_config(model.config))
    fused = sd["model.layers.2.mlp.experts.gate_up_proj"]  # [E, 2·f_e, h]: per expert cat(gate, up)
    for e in range(4):
        fc1 = mc[f"decoder.layers.2.mlp.experts.local_experts.{e}.linear_fc1.weight"]
        assert torch.equal(fc1, fused[e])
        fc2 = mc[f"decoder.layers.2.mlp.experts.local_experts.{e}.linear_fc2.weight"]
        assert torch.equal(fc2, sd["model.layers.2.mlp.experts.down_proj"][e])
    assert torch.equal(mc["decoder.layers.0.mlp.router.weight"], sd["model.layers.0.mlp.gate.weight"])


@pytest.mark.parametrize("tie", [True, False])
def test_llama_round_trip_is_bitwise_without_qk_norms(tie: bool) -> None:
    model = micro_llama(tie)
    shape = Qwen3Shape.from_hf_config(model.config)
    assert shape.qk_layernorm is False and shape.moe_layers == ()
    hf = _hf(model, tie)
    mc = hf_to_mcore(hf, shape)
    assert not any("layernorm" in k and "self_attention" in k for k in mc)
    _bitwise_equal(mcore_to_hf(mc, shape), hf)


def test_llama_biases_are_refused() -> None:
    cfg = micro_llama(tie=True).config.to_dict() | {"attention_bias": True}
    with pytest.raises(ConversionError, match="attention_bias=True"):
        Qwen3Shape.from_hf_config(cfg)


@pytest.mark.parametrize("tp", [1, 2])
def test_moe_tensor_parallel_shards_round_trip(tp: int) -> None:
    model = micro_moe(tie=False)
    shape = Qwen3Shape.from_hf_config(model.config, padded_vocab_size=128)
    mc = hf_to_mcore(_hf(model, False), shape)
    shards = [shard_tp(mc, shape, tp, r) for r in range(tp)]
    name = "decoder.layers.0.mlp.experts.local_experts.1."
    assert tp_split_dim(name + "linear_fc1.weight") == 0 and tp_split_dim(name + "linear_fc2.weight") == 1
    assert tp_split_dim("decoder.layers.0.mlp.router.weight") is None
    if tp == 2:  # rank 1 holds the second half of the expert's gate, then of its up
        fc1 = shards[1][name + "linear_fc1.weight"]
        gate_up = model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"][1]
        assert torch.equal(fc1, torch.cat([gate_up[12:24], gate_up[36:48]]))
        assert shards[1][name + "linear_fc2.weight"].shape == (64, 12)
    _bitwise_equal(gather_tp(shards, shape), mc)


def test_moe_shape_errors_name_the_value() -> None:
    model = micro_moe(tie=False)
    shape = Qwen3Shape.from_hf_config(model.config)
    hf = _hf(model, False)
    del hf["model.layers.2.mlp.experts.3.up_proj.weight"]
    with pytest.raises(ConversionError, match=r"model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight"):
        hf_to_mcore(hf, shape)
    fields = {f: getattr(shape, f) for f in shape.__slots__} | {"moe_router_topk": 5}
    with pytest.raises(ConversionError, match=r"1 <= moe_router_topk <= num_experts \(got 5\)"):
        Qwen3Shape.create(**fields)
    with pytest.raises(ConversionError, match="tensor_parallel=5 does not divide"):
        shard_tp(hf_to_mcore(_hf(model, False), shape), shape, 5, 0)


@pytest.mark.parametrize("family", ["moe", "moe_all_layers", "llama"])
def test_names_match_a_real_megatron_gpt_model_with_moe_layers(family: str, tmp_path: Path) -> None:
    """A GPTModel built by `build_gpt_model` from the shape (MoE layers: megatron's MoELayer, TopKRouter,
    SequentialMLP) holds exactly the converter's names and shapes, and loads and gives back the weights."""
    pytest.importorskip("megatron.core", reason="megatron-core (the megatron extra) is not installed")
    from safetensors.torch import save_file

    model = {
        "moe": lambda: micro_moe(tie=False),
        "moe_all_layers": lambda: micro_moe(tie=True, mlp_only_layers=()),
        "llama": lambda: micro_llama(tie=False),
    }[family]()
    tie = model.config.tie_word_embeddings
    shape = Qwen3Shape.from_hf_config(model.config, padded_vocab_size=128)
    hf = {k: v.contiguous() for k, v in _hf(model, tie).items()}
    save_file(hf, tmp_path / "hf.safetensors")
    fields = {f: getattr(shape, f) for f in shape.__slots__}
    args = json.dumps({"shape": fields, "hf": str(tmp_path / "hf.safetensors")})
    report = megatron_report(_GPT_SCRIPT, tmp_path, args)
    expected = {k: list(v.shape) for k, v in hf_to_mcore(hf, shape).items()}
    assert report["names"] == expected
    assert report["same"] is True
    if family != "llama":
        assert "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight" in report["names"]


_MOE_LAYER_SCRIPT = textwrap.dedent(
    """
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(1, 1)
    from megatron.core.transformer.moe import router
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from mopd_hpc.engines.megatron.convert import Qwen3Shape, hf_to_mcore
    from mopd_hpc.engines.megatron.convert_moe import split_fused_experts
    from mopd_hpc.engines.megatron.model import build_gpt_model, load_mcore_state

    # TopKRouter.gating moves a CPU weight to CUDA first; on this CUDA-less host it computes the same logits
    router.TopKRouter.gating = lambda self, x: torch.nn.functional.linear(x, self.weight)
    report = {}
    for norm in (True, False):
        torch.manual_seed(0)
        cfg = Qwen3MoeConfig(
            vocab_size=120, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_experts=8,
            num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, norm_topk_prob=norm)
        hf = Qwen3MoeForCausalLM(cfg)
        with torch.no_grad():
            hf.model.layers[0].mlp.gate.weight.normal_(0.0, 0.2)
        shape = Qwen3Shape.from_hf_config(cfg)
        model = build_gpt_model(shape, dtype="float32", cpu_init=True).eval()
        load_mcore_state(model, hf_to_mcore(split_fused_experts(hf.state_dict()), shape))
        x = torch.randn(7, 3, 64)  # [s, b, h], megatron's layout
        with torch.no_grad():
            out = model.decoder.layers[0].mlp(x)
            out = out[0] if isinstance(out, tuple) else out
            ref = hf.model.layers[0].mlp(x.transpose(0, 1).contiguous()).transpose(0, 1)
        report[str(norm)] = {"err": (out - ref).abs().max().item(), "scale": ref.abs().max().item(),
                             "pre_softmax": model.config.moe_router_pre_softmax}
    print(json.dumps(report))
    """
)


def test_megatron_moe_layer_equals_transformers_sparse_moe_block(tmp_path: Path) -> None:
    """megatron-core's MoELayer (TopKRouter, allgather dispatcher, SequentialMLP) built by `build_gpt_model`
    with the converter's weights gives transformers' `Qwen3MoeSparseMoeBlock` output in float32 (1e-6, against
    outputs of ~1e-2), with norm_topk_prob true (top k, then softmax over the k) and false (softmax over all
    E, then top k): routing and expert math agree on CPU. The router's gating (a CUDA move, then the same
    linear) is replaced by the linear; the whole model on a GPU: tests/engines/test_megatron_moe_gpu.py."""
    report = megatron_report(_MOE_LAYER_SCRIPT, tmp_path)
    assert report["True"]["pre_softmax"] is False and report["False"]["pre_softmax"] is True
    for r in report.values():
        assert r["err"] < 1e-6 and r["scale"] > 1e-3, report


_ROPE_SCRIPT = textwrap.dedent(
    """
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(1, 1)
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from mopd_hpc.engines.megatron.convert import Qwen3Shape
    from mopd_hpc.engines.megatron.build import rope_theta
    from mopd_hpc.engines.megatron.model import build_gpt_model
    from mopd_hpc.engines.megatron.rope import megatron_rope_scaling

    report = {}
    for factor in (8.0, 32.0):  # Llama 3.1 / 3.3, Llama 3.2
        cfg = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=96, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=128, rope_theta=500000.0,
                          rope_scaling={"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
        hf_config = cfg.to_dict()
        model = build_gpt_model(Qwen3Shape.from_hf_config(hf_config), dtype="float32", cpu_init=True,
                                rope_theta=rope_theta(hf_config), rope_scaling_factor=megatron_rope_scaling(hf_config))
        ours = model.rotary_pos_emb.inv_freq.float()
        ref = LlamaRotaryEmbedding(cfg).inv_freq.float()
        plain = build_gpt_model(Qwen3Shape.from_hf_config(hf_config), dtype="float32", cpu_init=True,
                                rope_theta=rope_theta(hf_config)).rotary_pos_emb.inv_freq.float()
        report[str(factor)] = {"err": ((ours - ref).abs() / ref).max().item(),
                               "unscaled_err": ((plain - ref).abs() / ref).max().item()}
    print(json.dumps(report))
    """
)


def test_llama3_rope_scaling_gives_transformers_frequencies(tmp_path: Path) -> None:
    """A Llama 3.x config.json's llama3 RoPE scaling reaches megatron's GPTModel (`engines/megatron/rope.py`):
    its rotary inverse frequencies equal transformers' `LlamaRotaryEmbedding` (relative 1e-6) at factor 8
    (3.1/3.3) and 32 (3.2); without the scaling they would differ by the factor (the low frequencies)."""
    report = megatron_report(_ROPE_SCRIPT, tmp_path)
    for factor, r in report.items():
        assert r["err"] < 1e-6, report
        assert r["unscaled_err"] > 0.5 * (float(factor) - 1) / float(factor), report


def test_rope_scaling_megatron_cannot_reproduce_is_refused() -> None:
    from mopd_hpc.engines.megatron.rope import RopeScalingError, megatron_rope_scaling

    assert megatron_rope_scaling({"rope_theta": 1e6}) is None
    assert megatron_rope_scaling({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}) is None
    assert megatron_rope_scaling({"rope_scaling": {"rope_type": "llama3", "factor": 32.0}}) == 32.0
    with pytest.raises(RopeScalingError, match="rope_type='yarn'"):
        megatron_rope_scaling({"rope_scaling": {"type": "yarn", "factor": 4.0}})
    with pytest.raises(
        RopeScalingError, match="rope high_freq_factor=2.0: megatron-core's llama3 scaling fixes it to 4.0"
    ):
        megatron_rope_scaling(
            {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 2.0}}
        )
