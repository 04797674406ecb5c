"""Two examples of issue 19's Why, as a user meets them: `rollout.forked: false` (accepted with no effect before:
now refused by --check) and a megatron trainer group with more GPUs than the actor role starts (named by
--check, refused by mopd-submit before anything starts, the run directory untouched)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers_configs import submit_here

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"


@pytest.mark.parametrize(
    ("config", "mode"),
    [("slurm_het_cpu.yaml", "separated"), ("local_cpu.yaml", "colocated")],
)
def test_unforked_rollout_is_refused_by_check(config: str, mode: str) -> None:
    rc, out, err = submit_here(str(CONFIGS / config), "--check", "--set", "rollout.forked=false")
    assert rc == 2 and out == ""
    (line,) = [line for line in err.splitlines() if "rollout.forked" in line]
    why = (
        "a colocated rollout must run as a forked child of the guard"
        if mode == "colocated"
        else "the job runs every rollout engine as a forked child of the node's guard; there is no unforked "
        "rollout (in the actor's process, or a server started elsewhere)"
    )
    assert line == (
        f"  - rollout.forked: {why} (got false; set rollout.forked: true (or leave it out: the default))"
    )
    rc, _, _ = submit_here(str(CONFIGS / config), "--check", "--set", "rollout.forked=true")
    assert rc == 0


MEGATRON_2GPU = [
    "--set", "models.actor.engine=megatron", "--set", "models.actor.dtype=bfloat16",
    "--set", "models.actor.optimizer.schedule=constant", "--set", "models.actor.optimizer.warmup_ratio=0",
    "--set", "cluster.trainer.gpus_per_node=2", "--set", "cluster.rollout.gpus_per_node=1",
]  # fmt: skip
NAMED = (
    "models.actor.engine: the actor role runs the megatron engine at data-parallel size ≤ 1 on GPUs: the actor "
    "has 2 trainer ranks (cluster.trainer.nodes × gpus_per_node = 1 × 2), dp 2 = world / "
    "(tensor_parallel·pipeline_parallel); more has not run yet: tests/engines/test_megatron_actor_group_gpu.py (2 GPUs) "
    "(got 'megatron'; one trainer slot (cluster.trainer.nodes × "
    "gpus_per_node), or engine: torch on CPU ranks, or allow_unverified: true (--allow-unverified) to run it "
    "unverified)"
)


def test_megatron_trainer_group_wider_than_the_actor_role_is_named_and_refused(tmp_path: Path) -> None:
    config = str(CONFIGS / "slurm_het_cpu.yaml")
    rc, out, err = submit_here(config, "--check", *MEGATRON_2GPU)
    # --check names it (a job gap: today a warning; `mopd-submit` refuses it below)
    assert (rc == 0 and f"# warning: not run by the job's roles yet: {NAMED}" in out) or (
        rc == 2 and NAMED in err
    )
    run_dir = tmp_path / "run"
    rc, out, err = submit_here(config, "--run-dir", str(run_dir), *MEGATRON_2GPU)
    assert rc == 2 and NAMED in err and "asks for what the job's roles do not run yet" in err
    assert not run_dir.exists()  # nothing prepared, nothing submitted
    # the same group at tensor_parallel 2: the megatron actor role starts one process, named as well
    rc, out, err = submit_here(
        config, "--run-dir", str(run_dir), *MEGATRON_2GPU, "--set", "models.actor.tensor_parallel=2"
    )
    assert (
        rc == 2
        and "models.actor.tensor_parallel: the actor role runs the megatron engine at tensor_parallel ≤ 1"
        in err
    )
    # one trainer GPU is what the role starts: no gap
    rc, out, err = submit_here(config, "--check", *MEGATRON_2GPU, "--set", "cluster.trainer.gpus_per_node=1")
    assert rc == 0 and "not run by the job's roles yet" not in out


def test_compile_decode_false_with_sglang_is_refused_naming_the_field() -> None:
    """`rollout.compile_decode` is the hf engine's switch: false with backend sglang would be ignored, so
    --check refuses it; with hf it passes (eager decoding)."""
    config = str(CONFIGS / "qwen3_8gpu_colocated.yaml")
    rc, out, err = submit_here(
        config, "--check", "--set", "rollout.backend=sglang", "--set", "rollout.compile_decode=false"
    )
    assert rc == 2 and out == ""
    (line,) = [line for line in err.splitlines() if "rollout.compile_decode" in line]
    assert line == (
        "  - rollout.compile_decode: it switches the hf engine's compiled decode step; sglang captures CUDA "
        "graphs of its own (got false; leave rollout.compile_decode out (true) with backend sglang)"
    )
    rc, _, err = submit_here(
        str(CONFIGS / "local_cpu.yaml"), "--check", "--set", "rollout.compile_decode=false"
    )
    assert rc == 0, err
