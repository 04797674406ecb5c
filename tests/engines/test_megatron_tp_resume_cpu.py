"""A tensor_parallel = 2 megatron resume restores Adam's state exactly (issue 31 item 5), on the sharded
optimizer state that the checkpoint writes and reads (trainer/sharded_checkpoint.py `save_tp_param_state` /
`load_tp_param_state`, `MegatronTrainEngine.tp_param_state` / `load_tp_param_state`).

megatron's GPTModel, DDP and DistributedOptimizer need CUDA, so each rank's engine is `MegatronTrainEngine`
built without its CUDA constructor over tests/engines/test_megatron_optimizer_state.py's stand-in distributed
optimizer (real torch Adam, megatron's dp_zero dict layout, ZeRO-1 sharding over a real gloo DP group) and
megatron-core's own lr scheduler. Four gloo processes form TP 2 × DP 2 (TP innermost, as
config/parallel.py orders the ranks: TP groups {0, 1}, {2, 3}; DP groups {0, 2}, {1, 3}); each TP rank holds
another shard (other weights), so each TP rank's optimizer state differs. The TP ranks' weights travel as
the sharded checkpoint's DCP pieces (tests/engines/test_sharded_checkpoint*.py); here the fresh engine takes them
from the saved model, as `load_shard_pieces` does, before the optimizer state.

Oracle: 2 steps, checkpoint, a fresh engine (other initial weights) loads, 1 step, against 3 steps straight:
each rank's fp32 main params, exp_avg and exp_avg_sq bitwise after the load and after step 3, the weights
bitwise after step 3; one file per TP rank, written and read by DP rank 0 alone (an audit hook: DP rank 1
never opens it); the two TP ranks' files differ. A checkpoint with another TP size's files restarts the
moments at 0 and says so. The same on GPUs: tests/engines/test_megatron_resume_gpu.py's TP = 2 case (2 GPUs).
"""

from __future__ import annotations

import logging
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_megatron_optimizer_state import _engine, _moments, _step, spawn_ranks

from mopd_hpc.engines.data_parallel import DataParallel
from mopd_hpc.trainer.checkpoint import load_checkpoint, save_checkpoint
from mopd_hpc.trainer.sharded_checkpoint import (
    TP_PARAM_STATE,
    load_tp_param_state,
    save_tp_param_state,
    tp_param_state_file,
)

TP, DP = 2, 2
WORLD = TP * DP
TIMEOUT_S = 180


def _tp_engine(seed: int, tp_rank: int, dp_group: Any) -> Any:
    """The stand-in engine (test_megatron_optimizer_state._engine) as TP rank `tp_rank` of TP 2, its optimizer
    sharded over `dp_group`."""
    engine = _engine(seed, dp_group)
    engine.shard_plan, engine.tp_rank = SimpleNamespace(tp=TP), tp_rank
    engine.data_parallel = DataParallel(dp_group.rank(), dp_group.size(), dp_group)
    return engine


def _rank(rank: int, tmp: str, answers: Any) -> None:
    try:
        opened: list[str] = []
        sys.addaudithook(
            lambda event, args: (
                opened.append(str(args[0]))
                if event == "open" and "optimizer_param_state.tp" in str(args[0])
                else None
            )
        )
        store = dist.FileStore(f"{tmp}/store", WORLD)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=90)
        )
        tp_rank, dp_rank = rank % TP, rank // TP
        dp_groups = [
            dist.new_group([t + TP * d for d in range(DP)]) for t in range(TP)
        ]  # every rank makes all
        dp_group = dp_groups[tp_rank]
        root = Path(tmp) / "ck"
        step_dir = root / "step_000002"
        saved = _tp_engine(tp_rank, tp_rank, dp_group)  # seed = TP rank: each TP rank's shard differs
        for k in (1, 2):
            _step(saved, k)
        written = save_tp_param_state(saved, step_dir)  # the shards first (a collective over the DP group)
        state = saved.state_dict()  # at TP > 1: no parameter state in it
        if rank == 0:
            save_checkpoint(root, 2, state, rng_state={})
        dist.barrier()
        at_two = {k: v.clone() for k, v in _moments(saved).items()}
        weights_at_two = {k: v.clone() for k, v in saved.model.state_dict().items()}  # the shards' pieces
        lr_at_two = saved.optimizer.param_groups[0]["lr"]
        _step(saved, 3)
        fresh = _tp_engine(7 + rank, tp_rank, dp_group)  # other initial weights
        opened_before_load = list(opened)
        fresh.load_state_dict(load_checkpoint(step_dir, verify_own_files=False).engine_state)
        zeroed = not _moments(fresh)["exp_avg"].any()  # what a TP resume did before: Adam restarted at 0
        fresh.model.load_state_dict(weights_at_two)  # load_shard_pieces: this TP rank's weights,
        fresh.optimizer.reload_model_params()  # and the main params from them
        loaded = load_tp_param_state(fresh, step_dir)  # DP rank 0 reads its TP rank's file, scatters
        report: dict[str, Any] = {
            "written": str(written) if written else None,
            "zeroed_before": zeroed,
            "loaded": loaded,
            "equal_after_load": all(torch.equal(_moments(fresh)[k], v) for k, v in at_two.items()),
            "lr_equal": fresh.optimizer.param_groups[0]["lr"] == lr_at_two,  # the scheduler's place
        }
        _step(fresh, 3)
        report["weights_equal_after_step_3"] = all(
            torch.equal(a, b)
            for a, b in zip(saved.model.state_dict().values(), fresh.model.state_dict().values(), strict=True)
        )
        report["equal_after_step_3"] = all(
            torch.equal(_moments(fresh)[k], v) for k, v in _moments(saved).items()
        )
        report["opened_before_load"] = opened_before_load
        report["opened"] = opened
        report["tp_rank"], report["dp_rank"] = tp_rank, dp_rank
        dist.destroy_process_group()
        answers.put((rank, report))
    except BaseException:
        answers.put((rank, traceback.format_exc()))


def test_tp2_resume_restores_adam_state_bitwise(tmp_path: Path) -> None:
    reports = spawn_ranks(_rank, WORLD, tmp_path, TIMEOUT_S)
    step_dir = tmp_path / "ck" / "step_000002"
    files = [tp_param_state_file(step_dir, t) for t in range(TP)]
    for rank, report in reports.items():
        assert report["zeroed_before"] is True  # load_state_dict alone: the moments at 0
        assert report["loaded"] is True and report["equal_after_load"] is True and report["lr_equal"] is True
        assert report["weights_equal_after_step_3"] is True and report["equal_after_step_3"] is True, rank
        own = str(files[report["tp_rank"]])
        if report["dp_rank"] == 0:  # writes and reads its TP rank's file, no other
            finals = {o for o in report["opened"] if not Path(o).name.startswith(".")}  # but the atomic temp
            assert report["written"] == own and finals == {own}
        else:  # DP rank 1 joins the gather and the scatter without opening a file
            assert report["written"] is None and report["opened"] == []
    zero, one = (torch.load(f, weights_only=True) for f in files)
    part = next(iter(zero[0][0].values()))
    assert part["exp_avg"].any() and not torch.equal(part["param"], next(iter(one[0][0].values()))["param"])


def test_another_tp_size_restarts_the_moments_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint saved at TP 1 (no per-TP-rank file) or at TP 4 (four files) resumed at TP 2: nothing is
    loaded (every rank sees the same files, so none starts a scatter), a warning names both sizes."""
    engine = _engine(0)
    engine.shard_plan, engine.tp_rank = SimpleNamespace(tp=TP), 0
    step_dir = tmp_path / "step_000002"
    with caplog.at_level(logging.WARNING, logger="mopd_hpc.trainer"):
        assert load_tp_param_state(engine, step_dir) is False
    step_dir.with_name("step_000002.shards").mkdir()
    for t in range(4):
        tp_param_state_file(step_dir, t).write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="mopd_hpc.trainer"):
        assert load_tp_param_state(engine, step_dir) is False
    assert [r.getMessage().split(": ")[-1] for r in caplog.records] == ["Adam's moments restart at 0"] * 2
    assert "holds the optimizer state of 4 TP rank(s), this actor has 2" in caplog.records[1].getMessage()
    assert TP_PARAM_STATE.format(rank=1) == "optimizer_param_state.tp1.pt"
