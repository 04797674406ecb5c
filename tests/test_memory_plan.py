"""The memory plan before anything starts (`engines/memory_plan.py`): per GPU of the job plan, each child's
holdings from the config and the models' config.json (`engines/memory_model.py`), the largest phase, the
`cluster.<group>.gpu_memory_gb` warning, and `mopd-submit --dry-run` / `--check` printing them.

The case is issue 21's: configs/local_gpu_colocated.yaml (megatron actor and teacher, HF rollout, Qwen3-0.6B
shapes, one GPU) at 16 × 4 × 64 and at the 64 × 4 × 256 that ran out of memory on an H200.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_models import write_stub_checkpoint

from mopd_hpc.config import load_run_config
from mopd_hpc.engines import memory_plan as mp
from mopd_hpc.engines.memory_model import ModelShape, default_micro_batch_tokens, micro_batch_bytes
from mopd_hpc.launch.placement import place_children

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "local_gpu_colocated.yaml"
QWEN3_0_6B = {
    "num_hidden_layers": 28, "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936, "tie_word_embeddings": True,
}  # fmt: skip
OOM = ["data.batch_size=64", "rollout.sampling.max_new_tokens=256"]
GIB = 2**30


def plan_of(sets: list[str], read=lambda path: QWEN3_0_6B):
    cfg = load_run_config(str(CONFIG), sets, False)
    return cfg, mp.memory_plan(cfg, place_children(cfg), read)


def holdings(gpu: mp.GpuMemory) -> dict[tuple[str, str], mp.Holding]:
    return {(c.label, h.what.split(" (")[0]): h for c in gpu.children for h in c.holdings}


def test_the_colocated_gpu_plan_from_the_formulas() -> None:
    cfg, gpus = plan_of(OOM)
    (gpu,) = gpus
    assert (gpu.group, gpu.node, gpu.gpu, gpu.capacity_gib) == ("group", 0, "0", None)
    assert [c.label for c in gpu.children] == ["actor 0", "teacher teacher", "rollout 0"]
    shape = ModelShape.from_hf_config(QWEN3_0_6B)
    p = shape.params
    h = holdings(gpu)
    assert h["actor 0", "weights"] == mp.Holding("weights", 2 * p)
    assert h["actor 0", "gradients"] == mp.Holding("gradients", 4 * p)  # megatron's fp32 grad buffer
    assert h["actor 0", "optimizer"].bytes == 12 * p  # fp32 main params + Adam moments, DP 1
    rows, length = 64 * 4, 64 + 256
    act = h["actor 0", "activations"]
    assert act.phase == "train" and act.what.startswith(f"activations ({rows * length:,} positions")
    assert act.bytes == micro_batch_bytes(shape, "bfloat16", "megatron", rows * length, rows * 256)
    assert h["teacher teacher", "weights"] == mp.Holding("weights", 2 * p, "teacher")
    rows_scored = (4 << 30) // (length * 151936 * 4)  # roles/teacher.py scoring_rows: 22
    assert h["teacher teacher", "scoring buffers"].bytes == rows_scored * 151936 * (length * 2 + 256 * 4)
    kv = h["rollout 0", "KV cache"]
    assert (kv.bytes, kv.phase) == (int(mp.HF_KV_GROWTH * rows * length * 28 * 2 * 8 * 128 * 2), "rollout")
    peak, phase = gpu.peak()
    resident = 2 * p + 4 * p + 12 * p + 2 * p  # actor state + rollout weights
    assert (peak, phase) == (resident + act.bytes, "train")
    assert gpu.children[1].in_phase("train") == 0 and gpu.children[1].in_phase("teacher") > 0
    lines = mp.format_memory_plan(gpus)
    assert lines[0].startswith("# memory plan per GPU")
    assert lines[1] == f"#   cluster.group node 0 GPU 0: {peak / GIB:.1f} at most (in train)"
    assert "the run caps it by the free memory" in lines[2]


#: The whole 64 × 4 × 256 step in one micro-batch (the OOM of issue 21).
WHOLE = "models.actor.micro_batch_tokens=81920"


def test_gpu_memory_gb_warns_when_the_plan_exceeds_it() -> None:
    _, gpus = plan_of([*OOM, WHOLE, "cluster.group.gpu_memory_gb=140"])
    (warning,) = mp.memory_warnings(gpus)
    peak = gpus[0].peak()[0] / GIB
    assert warning.startswith("cluster.group.gpu_memory_gb: the memory plan of node 0 GPU 0 is ")
    assert f"{peak:.1f} GiB in the train phase, more than the GPU's 140 GiB" in warning
    assert "largest: actor 0 activations" in warning and "micro_batch_tokens" in warning
    # A micro-batch budget brings the same step under the GPU's memory.
    _, fits = plan_of([*OOM, "cluster.group.gpu_memory_gb=140", "models.actor.micro_batch_tokens=16384"])
    assert mp.memory_warnings(fits) == [] and fits[0].peak()[0] < 100 * GIB
    assert "16,320 positions" in "\n".join(mp.format_memory_plan(fits))  # whole rows of 320 positions
    # Recompute shrinks the activations too.
    _, ckpt = plan_of([*OOM, WHOLE, "models.actor.activation_checkpointing=true"])
    assert ckpt[0].peak()[0] < gpus[0].peak()[0]


def test_a_null_budget_with_the_gpus_memory_known_is_the_one_the_engine_derives() -> None:
    """micro_batch_tokens null and 140 GiB: the budget is `default_micro_batch_tokens` of what the train phase
    leaves free (the GPU less the actor's state, the other children's train-phase holdings and a CUDA context
    per child), floored to whole rows; the step then fits."""
    cfg, gpus = plan_of([*OOM, "cluster.group.gpu_memory_gb=140"])
    (gpu,) = gpus
    shape = ModelShape.from_hf_config(QWEN3_0_6B)
    h = holdings(gpu)
    state = sum(h["actor 0", k].bytes for k in ("weights", "gradients", "optimizer"))
    others = h["rollout 0", "weights"].bytes  # the teacher is offloaded outside its phase here
    free = 140 * GIB - state - others - 3 * mp.CUDA_CONTEXT_BYTES
    budget = default_micro_batch_tokens(shape, "bfloat16", "megatron", free)
    positions = budget // 320 * 320
    act = h["actor 0", "activations"]
    assert act.what.startswith(f"activations ({positions:,} positions")
    assert act.bytes == micro_batch_bytes(shape, "bfloat16", "megatron", positions, positions * 256 // 320)
    assert mp.memory_warnings(gpus) == [] and gpu.peak()[0] <= 140 * GIB
    # Detected in the job instead of configured: the same plan.
    _, detected = plan_of(OOM)
    cfg2 = load_run_config(str(CONFIG), OOM, False)
    same = mp.memory_plan(cfg2, place_children(cfg2), lambda path: QWEN3_0_6B, capacity_gib=140.0)
    assert same == gpus and detected[0].capacity_gib is None


@pytest.mark.parametrize(("mode", "phase"), [("colocated", "rollout"), ("separated", None)])
def test_a_colocated_sglang_engine_holds_its_gpu_in_the_rollout_only(mode: str, phase: str | None) -> None:
    """It releases weights and KV pool when the step leaves ROLLOUT (trainer/rollout_memory.py)."""
    sets = ["rollout.backend=sglang", "weight_sync.backend=torch", "weight_sync.awex_mode=null"]
    sets += ["cluster.group.gpu_memory_gb=140"]
    if mode == "separated":
        sets += ["rollout.mode=separated", "cluster.group.gpus_per_node=2"]
    cfg, gpus = plan_of(sets)
    rollout = [h for gpu in gpus for c in gpu.children if c.label == "rollout 0" for h in c.holdings]
    assert [h.what.split(" (")[0] for h in rollout] == ["weights", "KV pool"]
    assert all(h.phase == phase for h in rollout)
    weights, pool = rollout
    assert weights.bytes + pool.bytes == int(mp.SGLANG_MEM_FRACTION * 140 * GIB)


def test_unreadable_models_and_cpu_jobs() -> None:
    cfg, gpus = plan_of([], read=lambda path: None)
    assert mp.format_memory_plan(gpus)[1] == "#   cluster.group node 0 GPU 0: not planned"
    assert "config.json not readable here: not planned" in mp.format_memory_plan(gpus)[2]
    assert mp.memory_warnings(gpus) == []
    cpu = load_run_config(str(REPO / "configs" / "local_cpu.yaml"), [], False)
    assert mp.memory_plan(cpu, place_children(cpu)) == ()
    assert mp.format_memory_plan(()) == ["# memory plan: no GPU in this job"]
    assert mp.plan_warnings(cpu, place_children(cpu)) == []


def test_constants_follow_the_engines_defaults() -> None:
    pytest.importorskip("torch")
    from mopd_hpc.engines.rollout.sglang_backend import SGLangLaunch
    from mopd_hpc.engines.teacher_serve import TeacherArgs
    from mopd_hpc.roles.teacher import SCORING_BUDGET_BYTES

    assert mp.TEACHER_ROWS == TeacherArgs.__dataclass_fields__["max_batch_rows"].default
    assert mp.SCORING_BUDGET_BYTES == SCORING_BUDGET_BYTES
    assert mp.SGLANG_MEM_FRACTION == SGLangLaunch.__dataclass_fields__["mem_fraction_static"].default


def mopd_submit(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MOPD_"))}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "mopd_hpc.cli.submit", *args], capture_output=True, text=True, timeout=120,
        cwd=cwd, env=env, check=False,
    )  # fmt: skip


def test_dry_run_prints_the_plan_and_check_warns(tmp_path: Path) -> None:
    for name in ("student", "teacher"):  # --check opens the files a child reads: a tokenizer, weights too
        write_stub_checkpoint(tmp_path / name, QWEN3_0_6B)
    sets = [f"models.actor.path={tmp_path / 'student'}", f"models.teachers.0.path={tmp_path / 'teacher'}"]
    sets += [f"models.tokenizer.path={tmp_path / 'student'}", *OOM, WHOLE, "cluster.group.gpu_memory_gb=140"]
    flags = [arg for s in sets for arg in ("--set", s)]
    dry = mopd_submit(str(CONFIG), "--dry-run", *flags, "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    assert "# memory plan per GPU (estimates, GiB; engines/memory_model.py):" in dry.stdout
    assert "#   cluster.group node 0 GPU 0: " in dry.stdout and " of 140 at most (in train)" in dry.stdout
    assert "# warning: cluster.group.gpu_memory_gb: the memory plan of node 0 GPU 0 is" in dry.stdout
    check = mopd_submit(str(CONFIG), "--check", *flags, cwd=tmp_path)
    assert check.returncode == 0, check.stderr
    assert "# warning: cluster.group.gpu_memory_gb: the memory plan" in check.stdout
