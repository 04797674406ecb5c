"""configs/qwen3_coder_4node.yaml (issue 33): a Qwen3-Coder-30B-A3B student and a Qwen3-235B-A22B-Instruct-2507
teacher, both mixtures of experts on megatron. With the models' config.json (tests/data/model_configs, from the
public Hugging Face configs) under the micro model's tokenizer and weights, `--check` refuses it naming what
has not run on GPUs (megatron's tensor and data parallel sizes; the Qwen3-MoE family itself has run, EP 1 on
an H100: benchmarks/moe_step.py) and the opt-in, `--check --allow-unverified` passes with them as warnings, and the memory plan of every GPU fits the H200 the config names: each model's weights a GPU are its
published parameter count (30.5B, 235B) · 2 bytes / tensor_parallel, within 2 %."""

from __future__ import annotations

from pathlib import Path

from test_gpu_configs import mopd_submit, real_shape

from mopd_hpc.config import load_run_config
from mopd_hpc.plan.memory_plan import GIB
from mopd_hpc.plan.placement import place_children
from mopd_hpc.plan.residency_plan import planned_residency

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "qwen3_coder_4node.yaml"
H200_GIB = 140.4  # what `gpu_type: H200-141GB` means to the plan (torch's total_memory)


def test_qwen3_coder_4node_passes_check_with_the_opt_in_and_fits_an_h200(tmp_path: Path) -> None:
    student = real_shape(tmp_path, "Qwen3-Coder-30B-A3B-Instruct")
    teacher = real_shape(tmp_path, "Qwen3-235B-A22B-Instruct-2507")
    sets = [
        f"models.actor.path={student}",
        f"models.tokenizer.path={student}",
        f"models.teachers.0.path={teacher}",
    ]
    args = [a for s in sets for a in ("--set", s)]

    refused = mopd_submit("--check", CONFIG, *args)
    assert refused.returncode == 2, refused.stderr
    for field in (
        "models.actor.tensor_parallel",
        "models.actor.engine",
        "models.teachers[0].tensor_parallel",
    ):
        assert f"  - {field}: " in refused.stderr, refused.stderr
    assert "Qwen3MoeForCausalLM" not in refused.stderr  # the family has run on megatron (EP 1)
    assert "or allow_unverified: true (--allow-unverified) to run it unverified" in refused.stderr

    proc = mopd_submit("--check", CONFIG, "--allow-unverified", *args)
    assert proc.returncode == 0, proc.stderr
    warned = [
        line.split(" = ")[0]
        for line in proc.stdout.splitlines()
        if line.startswith("# warning: unverified: ")
    ]
    assert [w[len("# warning: unverified: ") :] for w in warned] == [
        "models.actor.tensor_parallel", "models.actor.engine", "models.teachers[0].tensor_parallel",
    ]  # fmt: skip
    assert "memory plan: not checked" not in proc.stdout

    cfg = load_run_config(CONFIG, [*sets, "allow_unverified=true"])
    assert cfg.weight_sync.backend == "torch" and cfg.models.teachers[0].path == str(teacher)
    decision, gpus = planned_residency(cfg, place_children(cfg))
    assert (
        len(gpus) == 64 and not decision.offload
    )  # 32 trainer + 32 rollout GPUs; the teacher stays resident
    peaks = [gpu.peak()[0] / GIB for gpu in gpus]
    assert max(peaks) <= H200_GIB, max(peaks)
    actor_gpu = next(g for g in gpus if any(c.label.startswith("teacher") for c in g.children))
    held = {c.label.split()[0]: c.holding("weights").bytes / GIB for c in actor_gpu.children}
    for name, params, tp in (("actor", 30.5e9, 4), ("teacher", 235e9, 8)):
        expected = params * 2 / tp / GIB
        assert abs(held[name] - expected) / expected < 0.02, (name, held[name], expected)
    print(f"qwen3_coder_4node: {max(peaks):.1f} GiB per GPU at most (H200: {H200_GIB})")
