"""Expert parallelism of the megatron actor on CPU (issue 33): `MegatronTrainEngine` (its real constructor:
megatron-core's MoE GPTModel, DDP and distributed optimizer; tests/engines/megatron_ep_prog.py points their
CUDA placements at the CPU) over 2 real gloo processes at DP 2, with expert_parallel 2 (each rank holds 2 of
the 4 experts of each MoE layer, the allgather token dispatcher over the EP group, the expert gradients in
DDP's expert buffers over the expert-data-parallel group) against expert_parallel 1 (every expert on each
rank). Oracle: the EP 1 run, 2 steps of the same batches (a micro Qwen3-MoE: 2 MoE layers, 4 experts, top 2,
the checkpoint's load-balancing coefficient and a z-loss):

- the weights the sync sends (`named_weights`: every expert gathered over the EP group, HF names) equal the
  EP 1 ones bitwise before any step, and after each step within 3e-5 (float32, Adam at lr 1e-2: the
  order of the float sums differs, so a few elements whose gradient is near 0 move by another ±lr·g/√v;
  5e-6 typical, 1.2e-5 measured), every expert moved by the step;
- the loss, the router losses and every statistic equal within 1e-6 relative (float32), the token count
  exactly.

A checkpoint of step 1 resumes bitwise at the EP size it was saved at, and with the same weights at the
other (`test_checkpoint_of_step_1_resumes`).

The same on GPUs with NCCL and the alltoall dispatcher: tests/engines/test_megatron_ep_gpu.py (2 GPUs).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers_models import save_micro_moe
from helpers_ranks import run_ranks

PROG = (Path(__file__).parent / "megatron_ep_prog.py").read_text()


def _run(ep: int, moe: Path, out: Path, mode: str, *extra: str) -> dict:
    store = out / f"store_ep{ep}_{mode}{''.join('_' + Path(e).stem for e in extra)}"  # one file store a run
    run_ranks(PROG, lambda r: (str(r), "2", str(ep), str(store), str(moe), str(out), mode, *extra), 2)
    return torch.load(out / f"ep{ep}_{mode}.pt", weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, Path, Path]:
    pytest.importorskip("megatron.core", reason="megatron-core (the megatron extra) is not installed")
    out = tmp_path_factory.mktemp("ep")
    moe = save_micro_moe(out / "moe", seed=1)
    return _run(1, moe, out, "step"), _run(2, moe, out, "step"), moe, out


def test_ep2_train_steps_equal_the_ep1_steps(runs: tuple[dict, dict, Path, Path]) -> None:
    one, two, _, _ = runs
    assert (one["local_experts"], two["local_experts"]) == (
        2 * 2 * 4 * 2,
        2 * 2 * 2 * 2,
    )  # fc1, fc2 per expert
    for step in range(2):
        a, b = one["stats"][step], two["stats"][step]
        assert set(a) == set(b) and a["tokens"] == b["tokens"] == 12.0  # 3 + 3 + 4 + 2 response tokens
        assert a["router/load_balancing_loss"] > 0 and a["router/z_loss"] > 0
        for key, value in a.items():
            assert b[key] == pytest.approx(value, rel=1e-6, abs=1e-9), (step, key)


def test_ep2_sync_sends_every_expert_as_ep1(runs: tuple[dict, dict, Path, Path]) -> None:
    one, two, _, _ = runs
    assert set(one["initial"]) == set(two["initial"])
    experts = [k for k in one["initial"] if ".experts." in k]
    assert len(experts) == 2 * 4 * 3  # 2 layers × 4 experts × gate, up, down
    for name, w in one["initial"].items():
        assert torch.equal(two["initial"][name], w), name
    for step in range(2):
        before = one["initial"] if step == 0 else one["weights"][0]
        for name, w in one["weights"][step].items():
            torch.testing.assert_close(two["weights"][step][name], w, rtol=0, atol=3e-5, msg=name)
        for name in experts:
            assert (one["weights"][step][name] - before[name]).abs().max() > 1e-3, (step, name)


@pytest.mark.parametrize(("ep", "saved_ep"), [(2, 2), (1, 2)])
def test_checkpoint_of_step_1_resumes(runs: tuple[dict, dict, Path, Path], ep: int, saved_ep: int) -> None:
    """The checkpoint after step 1 (`state_dict`: every expert gathered over the EP group, the optimizers'
    states per EP rank) loaded by a fresh engine: at the EP size it was saved at, step 2 is bitwise the
    straight run's (weights, loss, lr of the cosine schedule); at another EP size (EP 2 → 1; EP 1 → 2 is the same code) the
    loaded weights are bitwise the saved ones, every expert included, and the lr schedule goes on (Adam
    starts again, so step 2 differs: engines/megatron/expert_checkpoint.py)."""
    one, two, moe, out = runs
    straight = two if saved_ep == 2 else one
    resumed = _run(ep, moe, out, "resume", str(out / f"ckpt_ep{saved_ep}.pt"))
    for name, w in straight["weights"][0].items():
        assert torch.equal(resumed["loaded"][name], w), name
    assert resumed["stats"][0]["lr"] == straight["stats"][1]["lr"] < straight["stats"][0]["lr"]
    if ep == saved_ep:
        assert resumed["stats"][0] == straight["stats"][1]
        for name, w in straight["weights"][1].items():
            assert torch.equal(resumed["weights"][0][name], w), name
