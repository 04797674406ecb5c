"""Expert parallelism of the megatron actor on CPU (issue 33): `MegatronTrainEngine` (its real constructor:
megatron-core's MoE GPTModel, DDP and distributed optimizer; tests/engines/megatron_ep_prog.py points their
CUDA placements at the CPU) over 2 real gloo processes at DP 2, with expert_parallel 2 (each rank holds 2 of
the 4 experts of each MoE layer, the allgather token dispatcher over the EP group, the expert gradients in
DDP's expert buffers over the expert-data-parallel group) against expert_parallel 1 (every expert on each
rank). Oracle: the EP 1 run, 2 steps of the same batches (a micro Qwen3-MoE: 2 MoE layers, 4 experts, top 2,
the checkpoint's load-balancing coefficient and a z-loss):

- the weights the sync sends (`named_weights`: every expert gathered over the EP group, HF names) equal the
  EP 1 ones bitwise before any step, and after each step within 3e-5 (float32, Adam at lr 1e-2: the
  order of the float sums differs, so a few elements whose gradient is near 0 move by another ±lr·g/√v:
  1.2e-5 measured), every expert moved by the step;
- the loss, the router losses and every statistic equal within 1e-6 relative (float32), the token count
  exactly.

A checkpoint of step 1 resumes bitwise at the EP size it was saved at, and with the same weights at the
other (`test_checkpoint_of_step_1_resumes`).

The same on GPUs with NCCL and the alltoall dispatcher: tests/engines/test_megatron_ep_gpu.py (2 GPUs).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers_models import save_micro_moe
from helpers_ranks import run_ranks

from mopd_hpc.engines.memory.estimates import ModelShape, train_state

PROG = (Path(__file__).parent / "megatron_ep_prog.py").read_text()


def _run(ep: int, moe: Path, out: Path, *load: str) -> dict:
    run_ranks(
        PROG, lambda r: (str(r), "2", str(ep), str(out / f"store_ep{ep}"), str(moe), str(out), *load), 2
    )
    return torch.load(out / f"ep{ep}.pt", weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, Path, Path]:
    """(the EP 1 run, resumed from the EP 2 run's checkpoint; the EP 2 run, resumed from its own)."""
    pytest.importorskip("megatron.core", reason="megatron-core (the megatron extra) is not installed")
    out = tmp_path_factory.mktemp("ep")
    moe = save_micro_moe(out / "moe", seed=1)
    two = _run(2, moe, out)
    return _run(1, moe, out, str(out / "ckpt_ep2.pt")), two, moe, out


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


def test_the_memory_plan_counts_a_ranks_experts(runs: tuple[dict, dict, Path, Path]) -> None:
    """engines/memory/estimates.py `train_state` at expert_parallel e: the weights of E/e experts a MoE layer,
    as the real GPTModel of each EP size holds (float32: 4 bytes a parameter)."""
    one, two, moe, _ = runs
    shape = ModelShape.from_hf_config(json.loads((moe / "config.json").read_text()))
    for ep, run in ((1, one), (2, two)):
        assert train_state(shape, "float32", "megatron", 1, 2, ep).weights == 4 * run["rank_params"]
    assert one["rank_params"] - two["rank_params"] == shape.expert_params // 2 > 0


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


def test_checkpoint_of_step_1_resumes(runs: tuple[dict, dict, Path, Path]) -> None:
    """The checkpoint of the EP 2 run after step 1 (`state_dict`: every expert gathered over the EP group, the
    optimizers' states per EP rank) loaded by a fresh engine: at EP 2, step 2 is bitwise the straight run's
    (weights, loss, lr of the cosine schedule); at EP 1 the loaded weights are bitwise the saved ones, every
    expert included, and the lr schedule goes on (Adam starts again, so step 2 differs:
    engines/megatron/expert_checkpoint.py)."""
    one, two, _, _ = runs
    for resumed in (one, two):
        for name, w in two["weights"][0].items():
            assert torch.equal(resumed["loaded"][name], w), name
        assert resumed["resumed_stats"]["lr"] == two["stats"][1]["lr"] < two["stats"][0]["lr"]
    assert two["resumed_stats"] == two["stats"][1]
    for name, w in two["weights"][1].items():
        assert torch.equal(two["resumed"][name], w), name
    assert any(not torch.equal(one["resumed"][k], w) for k, w in two["weights"][1].items())  # Adam anew


def test_the_build_refuses_an_ep_that_does_not_divide_the_experts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The engine's own re-check (`build_from_hf`, before any model is built): EP 3 over 4 experts, and EP 2
    for a dense model, name models.actor.expert_parallel."""
    pytest.importorskip("megatron.core", reason="megatron-core (the megatron extra) is not installed")
    from mopd_hpc.engines.megatron import build, parallel
    from mopd_hpc.engines.protocol import EngineError

    config = json.loads((save_micro_moe(tmp_path / "moe") / "config.json").read_text())
    dense = {k: v for k, v in config.items() if k not in ("num_experts", "num_local_experts")}
    monkeypatch.setattr(parallel, "tp_info", lambda: (1, 0, None))
    for ep, hf_config, experts in ((3, config, 4), (2, dense, 0)):
        monkeypatch.setattr(build, "ep_info", lambda ep=ep: (ep, 0, None))
        with pytest.raises(EngineError, match=f"expert_parallel={ep}: the model has {experts} experts a MoE"):
            build.build_from_hf(None, hf_config, "float32", torch.device("cpu"))
