"""Sharded checkpoints of a TP actor's weights (trainer/sharded_checkpoint.py) through
torch.distributed.checkpoint, on CPU: two real gloo ranks save their TP = 2 pieces of a real tiny HF Qwen3;
the checkpoint loads at TP = 1 (this process, no process group) and at TP = 4 (four gloo ranks), and every
load gathers back to the HF tensors bitwise. Oracle: the HF state dict itself.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from helpers_ports import free_port
from helpers_ranks import run_ranks
from test_megatron_shard_plan import assert_bitwise, hf_state, micro_qwen3

from mopd_hpc.engines.megatron.convert import ConversionError, Qwen3Shape
from mopd_hpc.engines.megatron.shard_plan import ShardPlan
from mopd_hpc.trainer.sharded_checkpoint import load_shards, save_shards, saved_shapes, shards_dir

_RANK = textwrap.dedent(
    """
    import json, sys
    import torch, torch.distributed as dist
    from safetensors.torch import load_file, save_file
    from torch.distributed.device_mesh import init_device_mesh
    from mopd_hpc.engines.megatron.convert import Qwen3Shape
    from mopd_hpc.engines.megatron.shard_plan import ShardPlan
    from mopd_hpc.trainer.sharded_checkpoint import load_shards, save_shards

    rank, world, args = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args['port']}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    plan = ShardPlan.create(Qwen3Shape.create(**args["shape"]), world)
    if args["do"] == "save":
        hf = load_file(args["hf"])
        save_shards(args["dir"], plan, plan.pieces(hf, rank), mesh)
    else:
        pieces = load_shards(args["dir"], plan, mesh)
        save_file(pieces, f"{args['out']}/rank{rank}.safetensors")
    dist.destroy_process_group()
    """
)


def _ranks(world: int, args: dict) -> None:
    args = dict(args, port=free_port())
    run_ranks(_RANK, lambda r: (str(r), str(world), json.dumps(args)), world)


@pytest.mark.parametrize("tie", [False, True])
def test_save_at_tp2_load_at_tp1_and_tp4(tie: bool, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model = micro_qwen3(tie, torch.bfloat16)
    hf = hf_state(model, tie)
    shape = Qwen3Shape.from_hf_config(model.config, padded_vocab_size=128)
    save_file({k: v.contiguous() for k, v in hf.items()}, tmp_path / "hf.safetensors")
    directory = shards_dir(tmp_path / "checkpoints" / "step_000002")
    assert directory.name == "step_000002.shards"
    args = {"shape": {f: getattr(shape, f) for f in shape.__slots__}, "hf": str(tmp_path / "hf.safetensors"),
            "dir": str(directory), "out": str(tmp_path)}  # fmt: skip
    _ranks(2, args | {"do": "save"})
    assert sorted(p.name for p in directory.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    shapes = saved_shapes(directory)
    assert shapes["model.embed_tokens.weight"] == (128, 64)  # the padded vocabulary
    assert shapes["model.layers.1.self_attn.q_proj.weight"] == (64, 64)
    # TP 1, this process alone
    plan1 = ShardPlan.create(shape, 1)
    assert_bitwise(plan1.gather_all([load_shards(directory, plan1)]), hf)
    # TP 4, four gloo ranks (one query group each)
    _ranks(4, args | {"do": "load"})
    plan4 = ShardPlan.create(shape, 4)
    pieces = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(4)]
    for r in range(4):
        assert_bitwise(pieces[r], plan4.pieces(hf, r))
    assert_bitwise(plan4.gather_all(pieces), hf)


def test_another_padding_is_refused_naming_both(tmp_path: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    model = micro_qwen3(False)
    hf = hf_state(model, False)
    shape = Qwen3Shape.from_hf_config(model.config, padded_vocab_size=128)
    plan = ShardPlan.create(shape, 1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        save_shards(tmp_path / "s", plan, plan.pieces(hf, 0), init_device_mesh("cpu", (1,)))
    finally:
        dist.destroy_process_group()
    assert_bitwise(plan.gather_all([load_shards(tmp_path / "s", plan)]), hf)
    other = ShardPlan.create(Qwen3Shape.from_hf_config(model.config, padded_vocab_size=256), 1)
    with pytest.raises(ConversionError, match=r"saved with global shape \[128, 64\].*expects \[256, 64\]"):
        load_shards(tmp_path / "s", other)
