"""The megatron actor at DP × TP on two GPUs (issue 18): the engine path the actor group runs (each rank
`initialize_parallel(rank, world, tp, device)`, `MegatronTrainEngine` on its DP shard of the step, the weights
gathered per HF tensor over the TP group, sharded checkpoints through torch.distributed.checkpoint), on
RECORDED rollouts: three fixed steps of rows written once (bf16 weights that differ would sample different
rows, so every layout replays the same ones, as the issue asks).

Layouts (NCCL, ports picked free on 127.0.0.1): TP 1 × DP 1 (one GPU), TP 2 × DP 1 and TP 1 × DP 2 (two GPUs).
Each trains steps 1-2, checkpoints at step 2 (`save_engine_shards` + the engine's state_dict), trains step 3;
then fresh processes of the same layout resume from step 2 (`load_state_dict` + `load_engine_shards`) and
train step 3 again.

Tolerances (bfloat16 weights, fp32 loss and grad reduction; lr 1e-3, one Adam step per training step):
- step losses of TP 2 and DP 2 vs TP 1 × DP 1: |Δ| ≤ 2e-2·|loss| + 1e-3. Why: bf16 keeps 8 mantissa bits
  (relative rounding 2^-9 ≈ 2e-3 per stored value); at TP 2 the row-parallel linears (o_proj, down_proj)
  sum two partial products, each rounded to bf16, before the all-reduce, and the column-parallel ones
  split the GEMM, so every layer's output may differ by about one bf16 ulp (≈ 4e-3 relative) from TP 1;
  over 2 layers and the log-softmax this stays well within 1e-2 relative of a token-mean loss, and later
  steps add the weight differences below. DP 2 splits the rows only (fp32 gradient reduce), so its error is
  smaller, and the same bound holds.
- exported weights after step 3 (bf16): every element within 3·(2·lr) + 2 bf16 ulps of the TP 1 × DP 1
  weights, and ≥ 99 % within 1 ulp + 1e-6. Why: Adam's early steps move an element by about ±lr·g/|g|; a
  gradient of the other sign near 0 moves it by up to 2·lr per step (3 steps), and each bf16 store rounds
  by up to an ulp.
- resume: the weights the resumed ranks hold at step 2 equal the uninterrupted run's step-2 weights bitwise
  (the sharded checkpoint round trip), so the resumed step 3 LOSS equals the uninterrupted one exactly (it is
  computed before the update). At TP 1 × DP 2 the checkpoint carries the distributed optimizer's parameter
  state gathered from both DP ranks (engines/megatron/optimizer_state.py), and at TP 2 each TP rank's state
  in a file of its own beside the shards (trainer/sharded_checkpoint.py `save_tp_param_state`; issue 31), so
  the resumed step-3 weights equal the uninterrupted ones bitwise in both layouts (the CPU counterpart of the
  TP 2 case: tests/engines/test_megatron_tp_resume_cpu.py).
Also: the TP 2 ranks' gathered exports are identical, and equal `full_mcore_state`'s whole-model gather
converted with `mcore_to_hf` bitwise (the per-tensor gather of weight sync is the old path's result).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers_ports import free_port

REPO = Path(__file__).resolve().parents[2]
LR = 1e-3
STEPS = 3
ULP = torch.finfo(torch.bfloat16).eps  # relative spacing of bf16 at 1.0 (2^-7)

_RANK = (
    textwrap.dedent(
        """
    import json, os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    from mopd_hpc.config.loss import LossConfig
    from mopd_hpc.config.models import OptimizerConfig
    from mopd_hpc.engines.batch import TokenBatch, TrainBatch
    from mopd_hpc.engines.megatron.convert import mcore_to_hf
    from mopd_hpc.engines.megatron.build import build_from_hf, read_hf_checkpoint
    from mopd_hpc.engines.megatron.engine import MegatronTrainEngine
    from mopd_hpc.engines.megatron.parallel import initialize_parallel
    from mopd_hpc.mopd.targets import TeacherTargets
    from mopd_hpc.trainer.sharded_checkpoint import load_engine_shards, save_engine_shards
    from mopd_hpc.trainer.shards import shard_rows

    def run(rank, world, tp, root, port, out, resume):
        device = initialize_parallel(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                                     tensor_parallel=tp, device_index=rank)
        steps = torch.load(os.path.join(root, "steps.pt"))
        config, _ = read_hf_checkpoint(os.path.join(root, "ckpt"))
        model, shape = build_from_hf(os.path.join(root, "ckpt"), config, "bfloat16", device)
        engine = MegatronTrainEngine(model, shape, config, LossConfig(), OptimizerConfig(lr=LR_VALUE), device,
                                     "bfloat16")
        dp = engine.data_parallel
        ckpt = os.path.join(out, "step_000002")
        report = {"losses": {}, "rank": rank}
        first = 1
        if resume:
            engine.load_state_dict(torch.load(ckpt + ".pt", weights_only=False))
            load_engine_shards(engine, ckpt)
            report["resumed_weights"] = {k: v.cpu() for k, v in engine.named_weights()}
            first = 3
        for step in range(first, STEPS_VALUE + 1):
            data = steps[step - 1]
            lengths = [len(o) for o in data["outputs"]]
            shard = shard_rows(lengths, dp.size)[dp.rank]
            lo, hi = shard.start, shard.stop
            tokens = TokenBatch.from_samples(data["prompts"][lo:hi], data["outputs"][lo:hi], pad_id=0)
            width = tokens.response_width
            behavior = data["behavior"][lo:hi, :width].clone()
            targets = TeacherTargets(data["target"][lo:hi, :width].clone(), torch.ones_like(behavior))
            stats = engine.train_step(TrainBatch.create(tokens, behavior_logprobs=behavior, targets=targets))
            report["losses"][step] = stats["loss"]
            if step == 2 and not resume:
                save_engine_shards(engine, ckpt)
                state = engine.state_dict()  # every rank: at TP 1 × DP 2 it gathers the optimizer's shards
                if rank == 0:
                    torch.save(state, ckpt + ".pt")
                torch.distributed.barrier()
                report["step2_weights"] = {k: v.cpu() for k, v in engine.named_weights()}
        weights = {k: v.cpu() for k, v in engine.named_weights()}
        if not resume:
            full = mcore_to_hf({k: v.cpu() for k, v in engine.full_mcore_state().items()}, shape)
            report["old_path_same"] = set(full) == set(weights) and all(torch.equal(full[k], weights[k]) for k in full)
        report["weights"] = weights
        torch.save(report, os.path.join(out, f"rank{rank}{'_resumed' if resume else ''}.pt"))
    """
    )
    .replace("LR_VALUE", repr(LR))
    .replace("STEPS_VALUE", str(STEPS))
)

_SETUP = textwrap.dedent(
    """
    import os, sys, torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    root = sys.argv[1]
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      tie_word_embeddings=False, torch_dtype="bfloat16")
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(os.path.join(root, "ckpt"))
    g = torch.Generator().manual_seed(1)
    steps = []
    for step in range(3):  # the recorded rollouts: 4 rows a step (2 per DP rank)
        prompts = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (5, 9, 3, 6)]
        outputs = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (7, 4, 11, 6)]
        width = max(len(o) for o in outputs)
        steps.append({"prompts": prompts, "outputs": outputs,
                      "behavior": -torch.rand(4, width, generator=g) * 5,
                      "target": -torch.rand(4, width, generator=g) * 5})
    torch.save(steps, os.path.join(root, "steps.pt"))
    """
)

_LAUNCH = textwrap.dedent(
    """
    import torch.multiprocessing as mp
    if __name__ == "__main__":
        root, port, out, world, tp, resume = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6] == "1"
        os.makedirs(out, exist_ok=True)
        mp.spawn(run, args=(world, tp, root, port, out, resume), nprocs=world, join=True)
    """
)


def _python(script: Path, *args: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=480, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


def _layout(root: Path, world: int, tp: int, resume: bool) -> list[dict]:
    script = root / "launch.py"
    script.write_text(_RANK + _LAUNCH)
    out = root / f"w{world}_tp{tp}"
    _python(script, str(root), str(free_port()), str(out), str(world), str(tp), "1" if resume else "0")
    suffix = "_resumed" if resume else ""
    return [torch.load(out / f"rank{r}{suffix}.pt", weights_only=False) for r in range(world)]


def _loss_close(a: float, b: float) -> bool:
    return abs(a - b) <= 2e-2 * abs(a) + 1e-3


def _weights_close(ref: dict, got: dict, moves: float, share_within_ulp: float) -> None:
    assert set(ref) == set(got)
    worst_excess, within, total = 0.0, 0, 0
    for name in ref:
        a, b = ref[name].double(), got[name].double()
        ulp = a.abs().clamp_min(1e-3) * ULP
        diff = (a - b).abs()
        worst_excess = max(worst_excess, float((diff - moves - 2 * ulp).max()))
        within += int((diff <= ulp + 1e-6).sum())
        total += diff.numel()
    assert worst_excess <= 0, worst_excess
    assert within / total >= share_within_ulp, within / total


@pytest.mark.gpu
def test_tp2_and_dp2_step_like_tp1_and_resume_from_sharded_checkpoints(tmp_path: Path) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip(
            f"needs 2 CUDA devices (megatron TP/DP ranks: NCCL refuses two ranks on one GPU); "
            f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} here"
        )
    pytest.importorskip("megatron.core", reason="megatron-core (the megatron extra) is not installed")
    setup = tmp_path / "setup.py"
    setup.write_text(_SETUP)
    _python(setup, str(tmp_path))
    ref = _layout(tmp_path, 1, 1, False)[0]
    for world, tp in ((2, 2), (2, 1)):
        ranks = _layout(tmp_path, world, tp, False)
        for rep in ranks:
            for step in range(1, STEPS + 1):
                assert _loss_close(ref["losses"][step], rep["losses"][step]), (world, tp, step, rep["losses"])
            assert rep["old_path_same"] is True
        for k in ranks[0]["weights"]:  # every rank exports the same weights
            assert torch.equal(ranks[0]["weights"][k], ranks[1]["weights"][k]), k
        _weights_close(ref["weights"], ranks[0]["weights"], STEPS * 2 * LR, 0.99)
        resumed = _layout(tmp_path, world, tp, True)
        for before, after in zip(ranks, resumed, strict=True):
            step2, back = before["step2_weights"], after["resumed_weights"]
            assert all(torch.equal(step2[k], back[k]) for k in step2)  # the checkpoint round trip
            assert after["losses"][3] == before["losses"][3]  # computed from the same step-2 weights
            # the distributed optimizer's state (main params, moments) was saved: exact, at TP 1 in the engine's
            # state_dict, at TP 2 one file per TP rank beside the shards (sharded_checkpoint.save_tp_param_state)
            assert all(torch.equal(before["weights"][k], after["weights"][k]) for k in before["weights"])
