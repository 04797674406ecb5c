"""Expert parallel 2 of the megatron actor on two GPUs (issue 33): NCCL, megatron-core's alltoall token
dispatcher (engines/megatron/expert_parallel.py `token_dispatcher`), DP 2, against expert_parallel 1 at DP 2
(every expert on each rank), from one micro Qwen3-MoE (2 MoE layers, 4 experts, top 2, the checkpoint's
load-balancing coefficient and a z-loss). The CPU twin (gloo, the allgather dispatcher):
tests/engines/test_megatron_ep_cpu.py; until this test has run, `models.actor.expert_parallel > 1` is refused
as unverified (config/capabilities.py `expert_parallel_untested`).

The two ranks' shards differ in shape ([2, L0] and [2, L1]: alltoall exchanges the token counts), and a
micro-batch budget splits rank 0's shard in two and leaves rank 1's in one, so rank 1 runs a stand-in
(`MegatronTrainEngine._expert_group_micro_batches`). Oracle, float32, 2 steps of Adam at lr 1e-3:

- the loss, the router losses and the statistics within 1e-5 relative of EP 1; the token count exactly;
- the weights the sync sends (`named_weights`, every expert, HF names) bitwise EP 1's before any step; after
  each step every element within 2·lr of EP 1 (Adam's first steps are ±lr·g/√v: a gradient near 0 that
  rounds to the other sign moves an element by up to 2·lr) and 99.9 % within 1e-5; both ranks send the same;
- a checkpoint of step 1 (`state_dict`, a collective over the DP and EP groups) loaded by a fresh EP 2 engine
  gives step 2 bitwise.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers_models import save_micro_moe
from helpers_ports import free_port

REPO = Path(__file__).resolve().parents[2]
LR = 1e-3

_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    import torch.multiprocessing as mp

    # budget 12 tokens: rank 0's rows (8, 4 positions: 2 × 8 > 12) run as 2 micro-batches, rank 1's (6, 5:
    # 2 × 6 ≤ 12) as 1, so rank 1 runs a stand-in second micro-batch at EP 2
    ROWS = [[1, 2, 3, 11, 12, 13, 14, 9], [4, 5, 15, 9], [6, 7, 8, 9, 16, 17], [3, 9, 10, 11, 12]]
    STARTS = [3, 2, 2, 4]

    def batch(step, rank):
        sys.path.insert(0, "tests/engines")  # run from the repository
        from helpers_ep import ep_batch
        return ep_batch(step, ROWS, STARTS, *((0, 2) if rank == 0 else (2, 4)))

    def run(rank, ep, ckpt, port, out):
        from mopd_hpc.config.loss import LossConfig
        from mopd_hpc.config.models import OptimizerConfig
        from mopd_hpc.engines.megatron.build import build_from_hf, read_hf_checkpoint
        from mopd_hpc.engines.megatron.engine import MegatronTrainEngine
        from mopd_hpc.engines.megatron.parallel import initialize_parallel
        from mopd_hpc.engines.micro_batch import MicroBatching
        device = initialize_parallel(rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port,
                                     tensor_parallel=1, device_index=rank, expert_parallel=ep)
        config, _ = read_hf_checkpoint(ckpt)

        def engine():
            model, shape = build_from_hf(ckpt, config, "float32", device)
            return MegatronTrainEngine(
                model, shape, config, LossConfig(router_z_loss_coefficient=0.01),
                OptimizerConfig(lr=LR_VALUE, grad_clip=1.0, schedule="cosine"), device, "float32",
                MicroBatching(tokens=12), total_steps=3)

        actor = engine()
        weights = lambda e: {k: v.cpu().clone() for k, v in e.named_weights()}
        record = {"initial": weights(actor), "stats": [], "weights": [], "dispatcher":
                  actor.model.config.moe_token_dispatcher_type}
        for step in range(2):
            stats = actor.train_step(batch(step, rank))
            record["stats"].append({k: v for k, v in stats.items() if not k.startswith("time/")})
            record["weights"].append(weights(actor))
            if step == 0:  # as the job: rank 0 writes the state every rank joined, every rank loads the file
                state = actor.state_dict()
                if rank == 0:
                    torch.save(state, os.path.join(out, f"ckpt_ep{ep}.pt"))
                torch.distributed.barrier()
        resumed = engine()
        resumed.load_state_dict(torch.load(os.path.join(out, f"ckpt_ep{ep}.pt"), weights_only=False))
        record["resumed_stats"] = resumed.train_step(batch(1, rank))
        record["resumed_stats"] = {k: v for k, v in record["resumed_stats"].items() if not k.startswith("time/")}
        record["resumed"] = weights(resumed)
        torch.save(record, os.path.join(out, f"ep{ep}_rank{rank}.pt"))

    if __name__ == "__main__":
        ep, ckpt, port, out = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
        mp.spawn(run, args=(ep, ckpt, port, out), nprocs=2, join=True)
    """
).replace("LR_VALUE", repr(LR))


def _run(ep: int, ckpt: Path, out: Path) -> list[dict]:
    script = out / "ep_script.py"
    script.write_text(_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(ep), str(ckpt), str(free_port()), str(out)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(out / f"ep{ep}_rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.gpu
def test_expert_parallel_2_matches_ep1_on_two_gpus(tmp_path: Path) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    pytest.importorskip("megatron.core", reason="megatron-core (the megatron extra) is not installed")
    ckpt = save_micro_moe(tmp_path / "moe", seed=1)
    one, two = _run(1, ckpt, tmp_path), _run(2, ckpt, tmp_path)
    assert one[0]["dispatcher"] == "allgather" and two[0]["dispatcher"] == "alltoall"
    for name, w in one[0]["initial"].items():
        assert torch.equal(two[0]["initial"][name], w), name
    for step in range(2):
        a, b = one[0]["stats"][step], two[0]["stats"][step]
        assert a["tokens"] == b["tokens"]
        assert b["micro_batches"] == two[1]["stats"][step]["micro_batches"] == 2  # rank 1: one stand-in
        assert a["router/load_balancing_loss"] > 0 and a["router/z_loss"] > 0
        for key, value in a.items():
            if key != "micro_batches":
                assert b[key] == pytest.approx(value, rel=1e-5, abs=1e-8), (step, key)
        w1, w2 = one[0]["weights"][step], two[0]["weights"][step]
        assert set(w1) == set(w2) and sum(".experts." in k for k in w1) == 2 * 4 * 3
        diffs = torch.cat([(w1[k] - w2[k]).abs().flatten() for k in w1])
        assert diffs.max().item() <= 2 * LR + 1e-6, diffs.max().item()
        assert (diffs <= 1e-5).float().mean().item() >= 0.999
        for k, w in w2.items():
            assert torch.equal(two[1]["weights"][step][k], w), k
    for rank in range(2):  # the checkpoint of step 1 resumes bitwise at EP 2
        assert json.dumps(two[rank]["resumed_stats"], sort_keys=True) == json.dumps(
            two[rank]["stats"][1], sort_keys=True
        )
        for k, w in two[rank]["weights"][1].items():
            assert torch.equal(two[rank]["resumed"][k], w), k
