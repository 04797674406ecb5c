"""The megatron teacher's top-k at tensor parallel 2 on two GPUs (issue 20 deliver 2; the multi-GPU issue):
`MegatronScoringEngine.score(batch, k)` on both ranks of a TP = 2 group (NCCL, a free port on 127.0.0.1),
each holding half of the vocabulary, against TP = 1 and the torch engine on the same checkpoint.

Per-shard log-softmax normalizer all-reduced over the TP group, per-shard top-k with global ids, the
candidates all-gathered and merged (`mopd.vocab_parallel.vocab_parallel_score`). The checkpoint is
tests/engines/test_megatron_teacher_gpu.py's micro Qwen3 (vocab 250, float32 weights). Tolerances (float32): log-
probs and top-k log-probs within 2e-4 of the torch oracle and of TP = 1; top-k ids equal wherever the
oracle's top-(k+1) log-probs are more than 1e-4 apart (>= 80 % of the positions); both TP ranks answer the
same numbers bit for bit; no id ≥ 250.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers_ports import free_port
from test_megatron_teacher_gpu import ROWS, STARTS, TIE_GAP, TOL, TOP_K, VOCAB, save_checkpoint

from mopd_hpc.engines.batch import TokenBatch

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = textwrap.dedent(
    """
    import os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    import torch.multiprocessing as mp
    from mopd_hpc.engines.batch import TokenBatch
    from mopd_hpc.engines.megatron.scoring import MegatronScoringEngine
    from mopd_hpc.engines.megatron.parallel import initialize_parallel

    ROWS, STARTS, K = ROWS_VALUE, STARTS_VALUE, K_VALUE

    def run(rank, world, root, port):
        device = initialize_parallel(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                                     tensor_parallel=world, device_index=rank)
        engine = MegatronScoringEngine.from_pretrained(os.path.join(root, "ckpt"), dtype="float32",
                                                       device=device, max_batch_rows=2)
        batch = TokenBatch.from_rows(ROWS, STARTS, pad_id=0)
        lp, top = engine.score(batch, K)
        torch.save({"lp": lp, "ids": top.indices, "values": top.logprobs},
                   os.path.join(root, f"tp{world}_rank{rank}.pt"))

    if __name__ == "__main__":
        root, port, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
        if world == 1:
            run(0, 1, root, port)
        else:
            mp.spawn(run, args=(world, root, port), nprocs=world, join=True)
    """
)


def _run(root: Path, world: int) -> None:
    script = root / "score_tp.py"
    text = _SCRIPT.replace("ROWS_VALUE", repr(ROWS)).replace("STARTS_VALUE", repr(STARTS))
    script.write_text(text.replace("K_VALUE", repr(TOP_K)))
    proc = subprocess.run(
        [sys.executable, str(script), str(root), str(free_port()), str(world)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.gpu
def test_megatron_teacher_topk_at_tp2_matches_tp1_and_torch(tmp_path: Path) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices (tensor parallel 2)")
    pytest.importorskip("megatron.core", reason="megatron-core (the megatron extra) is not installed")
    from mopd_hpc.engines.torch.scoring import TorchScoringEngine

    ckpt = save_checkpoint(tmp_path / "ckpt", seed=0)
    batch = TokenBatch.from_rows(ROWS, STARTS, pad_id=0)
    mask = batch.response_mask
    ref_lp, ref_top = TorchScoringEngine.from_pretrained(ckpt, dtype="float32", device="cpu").score(
        batch, TOP_K + 1
    )
    _run(tmp_path, 1)
    _run(tmp_path, 2)
    tp1 = torch.load(tmp_path / "tp1_rank0.pt")
    ranks = [torch.load(tmp_path / f"tp2_rank{r}.pt") for r in range(2)]
    for key in ("lp", "ids", "values"):
        assert torch.equal(ranks[0][key], ranks[1][key]), key  # every rank of the group answers the same
    got = ranks[0]
    assert got["ids"].shape == (len(ROWS), batch.response_width, TOP_K)
    assert int(got["ids"][mask].max()) < VOCAB
    assert (got["lp"] - ref_lp)[mask].abs().max().item() < TOL
    assert (got["lp"] - tp1["lp"])[mask].abs().max().item() < TOL
    assert torch.all(got["lp"][~mask] == 0)
    assert (got["values"] - ref_top.logprobs[..., :TOP_K])[mask].abs().max().item() < TOL
    assert (got["values"] - tp1["values"])[mask].abs().max().item() < TOL
    ref_values = ref_top.logprobs[mask]  # [positions, K + 1]
    apart = (ref_values[:, :-1] - ref_values[:, 1:]).min(-1).values > TIE_GAP
    assert apart.float().mean().item() >= 0.8, apart.float().mean().item()
    assert torch.equal(got["ids"][mask][apart], ref_top.indices[mask][apart][:, :TOP_K])
    assert torch.equal(got["ids"][mask][apart], tp1["ids"][mask][apart])
