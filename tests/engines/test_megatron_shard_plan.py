"""Shard plans of HF Qwen3 tensors at megatron tensor parallel T = 1, 2, 4 (engines/megatron/shard_plan.py).

Oracles: the HF state dict itself (split into T shard sets and gathered back, bitwise), convert.py's
`shard_tp(hf_to_mcore(...))` (a rank's fused megatron shard), and, with megatron-core installed, a real GPTModel
built on CPU at TP = 2 in two gloo processes: it loads each rank's shard strictly (names and shapes) and the
pieces read back from its state dict gather to the HF tensors bitwise.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from helpers_ports import free_port
from helpers_ranks import run_ranks
from transformers import Qwen3Config, Qwen3ForCausalLM

from mopd_hpc.engines.megatron.convert import ConversionError, Qwen3Shape, hf_to_mcore, shard_tp
from mopd_hpc.engines.megatron.shard_plan import ShardPlan

REPO = Path(__file__).resolve().parents[2]


def micro_qwen3(tie: bool, dtype: torch.dtype = torch.float32, seed: int = 0) -> Qwen3ForCausalLM:
    """8 query heads in 4 KV groups (GQA 2:1, so TP 4 holds one group per rank), head dim 8, FFN 96."""
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, head_dim=8, max_position_embeddings=128, tie_word_embeddings=tie,
    )  # fmt: skip
    model = Qwen3ForCausalLM(cfg).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def hf_state(model: Qwen3ForCausalLM, tie: bool) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_split_and_gather_back_bitwise(tp: int, dtype: torch.dtype, tie: bool) -> None:
    model = micro_qwen3(tie, dtype)
    hf = hf_state(model, tie)
    # padded to 256 rows: at TP 4 rank 3's vocab piece (rows 192..255) is padding only
    shape = Qwen3Shape.from_hf_config(model.config, padded_vocab_size=256)
    plan = ShardPlan.create(shape, tp)
    assert list(plan.tensors) == list(hf)  # HF order, no lm_head when tied
    by_rank = [plan.pieces(hf, r) for r in range(tp)]
    assert_bitwise(plan.gather_all(by_rank), hf)
    # a rank's fused megatron shard is convert.py's shard of the TP-1 megatron state
    full_mc = hf_to_mcore(hf, shape)
    for r in range(tp):
        mc_r = plan.mcore_shard(by_rank[r])
        assert set(mc_r) == set(full_mc)
        assert_bitwise(mc_r, shard_tp(full_mc, shape, tp, r))
        assert_bitwise(plan.hf_pieces(mc_r), by_rank[r])  # and back, from what the rank holds


def test_pieces_are_the_expected_slices() -> None:
    model = micro_qwen3(tie=False)
    hf = hf_state(model, False)
    plan = ShardPlan.create(Qwen3Shape.from_hf_config(model.config, padded_vocab_size=256), 4)
    q = "model.layers.1.self_attn.q_proj.weight"
    # rank 2 holds query group 2: query heads 4, 5 (8 rows each) and KV head 2
    assert torch.equal(plan.split(q, hf[q], 2), hf[q][32:48])
    k = "model.layers.1.self_attn.k_proj.weight"
    assert torch.equal(plan.split(k, hf[k], 2), hf[k][16:24])
    o = "model.layers.0.self_attn.o_proj.weight"
    assert torch.equal(plan.split(o, hf[o], 1), hf[o][:, 16:32])  # row-parallel: input columns
    down = "model.layers.0.mlp.down_proj.weight"
    assert plan.tensors[down].piece_shape == (64, 24) and plan.tensors[down].kind == "row"
    emb = "model.embed_tokens.weight"
    assert torch.equal(plan.split(emb, hf[emb], 1), hf[emb][64:120].new_zeros(64, 64).index_copy(
        0, torch.arange(56), hf[emb][64:120]))  # fmt: skip
    assert not plan.split(emb, hf[emb], 3).any()  # padding rows only
    norm = "model.layers.0.self_attn.q_norm.weight"
    assert plan.tensors[norm].kind == "replicated" and torch.equal(plan.split(norm, hf[norm], 3), hf[norm])
    # the fused linear_qkv of rank 2: its group's 2 query heads, then its key head, then its value head
    mc = plan.mcore_shard(plan.pieces(hf, 2))["decoder.layers.1.self_attention.linear_qkv.weight"]
    v = "model.layers.1.self_attn.v_proj.weight"
    assert torch.equal(mc, torch.cat([hf[q][32:48], hf[k][16:24], hf[v][16:24]]))


def test_errors_name_the_tensor_and_size() -> None:
    model = micro_qwen3(tie=False)
    shape = Qwen3Shape.from_hf_config(model.config, padded_vocab_size=256)
    with pytest.raises(ConversionError, match="tensor_parallel=8 does not divide num_query_groups=4"):
        ShardPlan.create(shape, 8)
    plan = ShardPlan.create(shape, 2)
    hf = hf_state(model, False)
    with pytest.raises(ConversionError, match="rank=2: expected 0 <= rank < tensor_parallel=2"):
        plan.split("model.norm.weight", hf["model.norm.weight"], 2)
    with pytest.raises(ConversionError, match="'model.nope' is not a tensor"):
        plan.split("model.nope", hf["model.norm.weight"], 0)
    pieces = [plan.pieces(hf, r) for r in range(2)]
    pieces[1]["model.norm.weight"] = pieces[1]["model.norm.weight"] + 1
    with pytest.raises(
        ConversionError, match="replicated model.norm.weight differs between TP rank 0 and rank 1"
    ):
        plan.gather_all(pieces)
    with pytest.raises(ConversionError, match="1 pieces for tensor_parallel=2"):
        plan.gather("model.norm.weight", pieces[:1])
    del hf["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(ConversionError, match="no 'model.layers.0.mlp.up_proj.weight'"):
        plan.pieces(hf, 0)


_GPT_TP_SCRIPT = textwrap.dedent(
    """
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    import torch, torch.distributed as dist
    from safetensors.torch import load_file, save_file
    rank, port, args = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(2, 1)
    from mopd_hpc.engines.megatron.convert import Qwen3Shape
    from mopd_hpc.engines.megatron.model import build_gpt_model, load_mcore_state
    from mopd_hpc.engines.megatron.shard_plan import ShardPlan
    shape = Qwen3Shape.create(**args["shape"])
    plan = ShardPlan.create(shape, 2)
    model = build_gpt_model(shape, dtype="float32", tensor_parallel=2, cpu_init=True)
    held = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)
            and not k.endswith("_extra_state")}
    shapes = {k: list(v.shape) for k, v in held.items()}
    mine = plan.mcore_shard(plan.pieces(load_file(args["hf"]), rank))
    load_mcore_state(model, mine)  # strict: every name and shape of this rank's GPTModel
    held = {k: v for k, v in model.state_dict().items() if k in mine}
    save_file({k: v.contiguous() for k, v in plan.hf_pieces(held).items()}, f"{args['out']}/rank{rank}.safetensors")
    print(json.dumps({"shapes": shapes, "tp": ps.get_tensor_model_parallel_world_size()}))
    """
)


@pytest.mark.parametrize("tie", [False, True])
def test_a_real_megatron_gpt_model_at_tp2_holds_the_planned_shards(tie: bool, tmp_path: Path) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core (the megatron extra) is not installed")
    from safetensors.torch import load_file, save_file

    model = micro_qwen3(tie)
    hf = hf_state(model, tie)
    shape = Qwen3Shape.from_hf_config(model.config, padded_vocab_size=128)
    save_file({k: v.contiguous() for k, v in hf.items()}, tmp_path / "hf.safetensors")
    fields = {f: getattr(shape, f) for f in shape.__slots__}
    args = json.dumps({"shape": fields, "hf": str(tmp_path / "hf.safetensors"), "out": str(tmp_path)})
    port = free_port()
    outs = run_ranks(_GPT_TP_SCRIPT, lambda r: (str(r), str(port), args))
    plan = ShardPlan.create(shape, 2)
    for r, out in enumerate(outs):
        report = json.loads(out.strip().splitlines()[-1])
        assert report["tp"] == 2
        expected = {k: list(v.shape) for k, v in plan.mcore_shard(plan.pieces(hf, r)).items()}
        assert report["shapes"] == expected
    pieces = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(2)]
    assert_bitwise(plan.gather_all(pieces), hf)
