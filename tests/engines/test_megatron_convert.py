"""HF Qwen3 ⇄ megatron-core conversion: exact round trips on micro Qwen3 models built with transformers,
the QKV group layout, tensor-parallel shards, and (with megatron-core installed) the names and shapes of a
real GPTModel built on CPU in a subprocess."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import helpers_fork
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from mopd_hpc.engines.megatron.convert import (
    ConversionError,
    Qwen3Shape,
    gather_tp,
    hf_to_mcore,
    mcore_to_hf,
    pack_qkv,
    pad_vocab_size,
    shard_tp,
    tp_split_dim,
)

REPO = Path(__file__).resolve().parents[2]


def megatron_report(script: str, tmp_path: Path, *args: str) -> dict:
    """The last stdout line (JSON) of `python -c script *args STORE`: megatron-core on one gloo rank (a file store
    under `tmp_path`); the assertion carries the stderr tail."""
    pytest.importorskip("megatron.core", reason="megatron-core (the megatron extra) is not installed")
    proc = helpers_fork.run(
        ["-c", script, *args, str(tmp_path / "pg_store")],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def micro_qwen3(tie: bool, dtype: torch.dtype = torch.float32, seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=120,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
    )
    model = Qwen3ForCausalLM(cfg).to(dtype)
    with torch.no_grad():  # norms start at 1: make them distinguishable
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bitwise(tie: bool, dtype: torch.dtype) -> None:
    model = micro_qwen3(tie, dtype)
    shape = Qwen3Shape.from_hf_config(
        model.config, padded_vocab_size=pad_vocab_size(120, tp=2, divisible_by=64)
    )
    assert shape.padded_vocab_size == 128 and shape.heads_per_group == 2 and shape.qkv_rows == 128
    hf = {k: v for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
    mc = hf_to_mcore(model.state_dict(), shape)
    assert ("output_layer.weight" in mc) is (not tie)
    assert mc["embedding.word_embeddings.weight"].shape == (128, 64)
    assert torch.count_nonzero(mc["embedding.word_embeddings.weight"][120:]) == 0
    assert mc["decoder.layers.1.mlp.linear_fc1.weight"].shape == (192, 64)
    _bitwise_equal(mcore_to_hf(mc, shape), hf)


def test_qkv_is_grouped_per_query_group() -> None:
    shape = Qwen3Shape.create(
        num_layers=1, hidden_size=2, num_attention_heads=4, num_query_groups=2, head_dim=3,
        ffn_hidden_size=4, vocab_size=8, tie_word_embeddings=True,
    )  # fmt: skip
    q = torch.arange(12.0).repeat_interleave(2).view(12, 2)  # row r holds r
    k = 100 + torch.arange(6.0).repeat_interleave(2).view(6, 2)
    v = 200 + torch.arange(6.0).repeat_interleave(2).view(6, 2)
    rows = pack_qkv(q, k, v, shape)[:, 0].tolist()
    # group 0: q heads 0,1 (rows 0-5), k head 0 (100-102), v head 0 (200-202); then group 1
    assert rows == [0, 1, 2, 3, 4, 5, 100, 101, 102, 200, 201, 202,
                    6, 7, 8, 9, 10, 11, 103, 104, 105, 203, 204, 205]  # fmt: skip


def test_gate_up_and_norm_names() -> None:
    model = micro_qwen3(tie=False)
    sd = model.state_dict()
    shape = Qwen3Shape.from_hf_config(model.config)
    mc = hf_to_mcore(sd, shape)
    fc1 = mc["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[:96], sd["model.layers.0.mlp.gate_proj.weight"])
    assert torch.equal(fc1[96:], sd["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(
        mc["decoder.layers.0.self_attention.q_layernorm.weight"], sd["model.layers.0.self_attn.q_norm.weight"]
    )
    assert torch.equal(
        mc["decoder.layers.0.self_attention.k_layernorm.weight"], sd["model.layers.0.self_attn.k_norm.weight"]
    )
    assert torch.equal(
        mc["decoder.layers.1.pre_mlp_layernorm.weight"], sd["model.layers.1.post_attention_layernorm.weight"]
    )
    assert torch.equal(mc["decoder.final_layernorm.weight"], sd["model.norm.weight"])


@pytest.mark.parametrize("tp", [1, 2])
def test_tensor_parallel_shards_round_trip(tp: int) -> None:
    model = micro_qwen3(tie=False)
    shape = Qwen3Shape.from_hf_config(model.config, padded_vocab_size=128)
    mc = hf_to_mcore(model.state_dict(), shape)
    shards = [shard_tp(mc, shape, tp, r) for r in range(tp)]
    if tp == 2:
        sd = model.state_dict()
        fc1 = shards[1]["decoder.layers.0.mlp.linear_fc1.weight"]
        assert torch.equal(fc1[:48], sd["model.layers.0.mlp.gate_proj.weight"][48:])
        assert torch.equal(fc1[48:], sd["model.layers.0.mlp.up_proj.weight"][48:])
        # rank 1 holds query group 1 whole: q heads 2,3 then k head 1 then v head 1
        qkv = shards[1]["decoder.layers.0.self_attention.linear_qkv.weight"]
        assert torch.equal(qkv[:32], sd["model.layers.0.self_attn.q_proj.weight"][32:])
        assert torch.equal(qkv[32:48], sd["model.layers.0.self_attn.k_proj.weight"][16:])
        assert shards[0]["decoder.layers.0.self_attention.linear_proj.weight"].shape == (64, 32)
        assert shards[0]["output_layer.weight"].shape == (64, 64)
    _bitwise_equal(gather_tp(shards, shape), mc)
    assert tp_split_dim("decoder.layers.3.mlp.linear_fc2.weight") == 1
    assert tp_split_dim("decoder.layers.3.input_layernorm.weight") is None


def test_errors_name_the_key_and_value() -> None:
    model = micro_qwen3(tie=False)
    shape = Qwen3Shape.from_hf_config(model.config)
    sd = dict(model.state_dict())
    del sd["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ConversionError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        hf_to_mcore(sd, shape)
    sd = dict(model.state_dict())
    sd["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    with pytest.raises(ConversionError, match=r"k_proj\.weight has shape \[16, 64\]; expected \[32, 64\]"):
        hf_to_mcore(sd, shape)
    sd = dict(model.state_dict(), **{"model.layers.9.extra.weight": torch.zeros(1)})
    with pytest.raises(ConversionError, match="unexpected key"):
        hf_to_mcore(sd, shape)
    mc = hf_to_mcore(model.state_dict(), shape)
    with pytest.raises(ConversionError, match="tensor_parallel=3 does not divide num_query_groups=2"):
        shard_tp(mc, shape, 3, 0)
    with pytest.raises(ConversionError, match="not a multiple of num_query_groups"):
        Qwen3Shape.create(
            num_layers=1, hidden_size=8, num_attention_heads=3, num_query_groups=2, head_dim=4,
            ffn_hidden_size=8, vocab_size=8, tie_word_embeddings=True,
        )  # fmt: skip
    tied = micro_qwen3(tie=True)
    sd = dict(tied.state_dict(), **{"lm_head.weight": torch.zeros(120, 64)})
    with pytest.raises(ConversionError, match="tie_word_embeddings=True but lm_head"):
        hf_to_mcore(sd, Qwen3Shape.from_hf_config(tied.config))


_GPT_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(1, 1)
    from mopd_hpc.engines.megatron.convert import Qwen3Shape, hf_to_mcore, mcore_to_hf
    from mopd_hpc.engines.megatron.model import SDPACoreAttention, build_gpt_model, load_mcore_state
    from safetensors.torch import load_file
    args = json.loads(sys.argv[1])
    shape = Qwen3Shape.create(**args["shape"])
    model = build_gpt_model(shape, dtype="float32", cpu_init=True)
    attn = model.decoder.layers[0].self_attention.core_attention
    names = {k: list(v.shape) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    hf = load_file(args["hf"])
    load_mcore_state(model, hf_to_mcore(hf, shape))
    back = mcore_to_hf({k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}, shape)
    same = all(torch.equal(back[k], hf[k]) for k in back) and set(back) <= set(hf)
    # the fused core attention against the explicit causal softmax(QK^T/sqrt(d))V, GQA 2 heads per group
    torch.manual_seed(0)
    s, b = 5, 2
    q, k, v = torch.randn(s, b, 4, 16), torch.randn(s, b, 2, 16), torch.randn(s, b, 2, 16)
    out = attn(q, k, v, None)
    kk, vv = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, kk) / 4.0
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), vv).reshape(s, b, 64)
    print(json.dumps({"names": names, "same": same, "sdpa": isinstance(attn, SDPACoreAttention),
                      "attn_err": (out - ref).abs().max().item(), "out_shape": list(out.shape)}))
    """
)


@pytest.mark.parametrize("tie", [True, False])
def test_names_match_a_real_megatron_gpt_model(tie: bool, tmp_path: Path) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core (the megatron extra) is not installed")
    from safetensors.torch import save_file

    model = micro_qwen3(tie)
    shape = Qwen3Shape.from_hf_config(model.config, padded_vocab_size=128)
    hf = {k: v.contiguous() for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
    save_file(hf, tmp_path / "hf.safetensors")
    fields = {f: getattr(shape, f) for f in shape.__slots__}
    args = json.dumps({"shape": fields, "hf": str(tmp_path / "hf.safetensors")})
    report = megatron_report(_GPT_SCRIPT, tmp_path, args)
    expected = {k: list(v.shape) for k, v in hf_to_mcore(model.state_dict(), shape).items()}
    assert report["names"] == expected
    assert report["same"] is True
    assert report["sdpa"] is True
    assert report["out_shape"] == [5, 2, 64]
    assert report["attn_err"] < 1e-5


_GPU_SCRIPT = textwrap.dedent(
    """
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from mopd_hpc.config.loss import LossConfig
    from mopd_hpc.config.models import OptimizerConfig
    from mopd_hpc.engines.batch import TokenBatch, TrainBatch
    from mopd_hpc.engines.megatron.convert import hf_to_mcore, mcore_to_hf
    from mopd_hpc.engines.megatron.scoring import MegatronScoringEngine
    from mopd_hpc.engines.megatron.build import build_from_hf, read_hf_checkpoint
    from mopd_hpc.engines.megatron.engine import MegatronTrainEngine
    from mopd_hpc.engines.megatron.parallel import initialize_parallel
    from mopd_hpc.engines.torch.scoring import TorchScoringEngine
    from mopd_hpc.mopd.targets import TeacherTargets

    root = sys.argv[1]
    device = initialize_parallel(rank=0, world_size=1, master_addr="127.0.0.1", master_port=int(sys.argv[2]),
                                 tensor_parallel=1, device_index=0)
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      tie_word_embeddings=False)
    Qwen3ForCausalLM(cfg).save_pretrained(root)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (5, 9, 3)]
    outputs = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (7, 4, 11)]
    batch = TokenBatch.from_samples(prompts, outputs, pad_id=0)
    report = {}
    scorer = MegatronScoringEngine.from_pretrained(root, dtype="float32", device=device)
    hf = TorchScoringEngine.from_pretrained(root, dtype="float32", device="cuda")
    lp_mc, lp_hf = scorer.logprobs(batch), hf.logprobs(batch)
    report["score_err"] = (lp_mc - lp_hf).abs().max().item()
    report["score_mean"] = lp_mc[batch.response_mask].mean().item()
    before = torch.cuda.memory_allocated()
    scorer.offload()
    report["teacher_offload_freed"] = before - torch.cuda.memory_allocated()
    scorer.onload()
    report["teacher_onload_same"] = torch.equal(scorer.logprobs(batch), lp_mc)
    del scorer, hf
    config, state = read_hf_checkpoint(root)
    model, shape = build_from_hf(root, config, "float32", device)
    engine = MegatronTrainEngine(model, shape, config, LossConfig(), OptimizerConfig(lr=1e-3), device, "float32")
    full = engine.full_mcore_state()
    back = mcore_to_hf({k: v.cpu() for k, v in full.items()}, shape)
    report["export_exact"] = all(torch.equal(back[k], state[k]) for k in back)
    targets = TeacherTargets(lp_hf - 0.5, torch.ones_like(lp_hf))
    tb = TrainBatch.create(batch, behavior_logprobs=lp_hf.clone(), targets=targets)
    s1 = engine.train_step(tb)
    s2 = engine.train_step(tb)
    report["losses"] = [s1["loss"], s2["loss"]]
    report["grad_norm"] = s1["grad_norm"]
    lp_before = engine.logprobs(batch)
    before = torch.cuda.memory_allocated()
    engine.offload()  # optimizer first, then DDP buffers
    report["actor_offload_freed"] = before - torch.cuda.memory_allocated()
    engine.onload()
    report["actor_onload_same"] = torch.equal(engine.logprobs(batch), lp_before)
    report["step_after_onload"] = engine.train_step(tb)["loss"]
    print(json.dumps(report))
    """
)


@pytest.mark.gpu
def test_megatron_engines_on_gpu(tmp_path: Path) -> None:
    """Scoring equals the HF engine (float32), export is exact, train steps run, offload/onload round-trips."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("megatron.core", reason="megatron-core (the megatron extra) is not installed")
    proc = subprocess.run(
        [sys.executable, "-c", _GPU_SCRIPT, str(tmp_path / "ckpt"), "29555"],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["score_err"] < 2e-4, report
    assert report["score_mean"] < 0
    assert report["teacher_offload_freed"] > 0 and report["teacher_onload_same"] is True
    assert report["export_exact"] is True
    assert all(math.isfinite(x) for x in report["losses"]) and report["grad_norm"] > 0
    assert report["actor_offload_freed"] > 0 and report["actor_onload_same"] is True
    assert math.isfinite(report["step_after_onload"])
