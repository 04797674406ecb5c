"""The production engines through the job's own roles (issue 8): `mopd-submit <config> --local` → one guard →
a Megatron actor (the controller), a Megatron teacher and an HF rollout engine; random Qwen3-0.6B-shape models
(benchmarks/gpu_models.py `ensure_models`). 3 steps, checkpoints at 2 and 3 (the last), the evaluation at start
and end. Two configs:
- configs/local_gpu_colocated_awex.yaml, one GPU: the three children on GPU 0, weights by AWEX colocate mode;
- configs/local_gpu_colocated.yaml as shipped (issue 35), one GPU: the rollout an in-process sglang.Engine,
  weights by the ipc sync (needs sglang; skipped without it);
- configs/local_gpu_separated.yaml, two GPUs: actor and teacher on GPU 0, rollout on GPU 1, weights by AWEX
  separate mode (NCCL between the two GPUs).

Issue 20 adds two runs of configs/local_gpu_colocated_awex.yaml (one GPU, the megatron actor): `loss.estimator:
topk` with `loss.correction: none` (the student's top-k reverse KL over the teacher's top-64, vocab-parallel
log-softmax) and `loss.rl_coefficient: 0.5` (GRPO at loss level); each run's per-phase figures, with its
engine, estimator, rl_coefficient and kl_coefficient, go to MOPD_GPU_JOB_OUT/<case>/summary.json.

Asserted: exit 0; one metrics line per step with a finite loss, every phase timed, and the rollouts of step s
sampled by the weights of step s − 1 (weight_version); checkpoints and the final HF student written; the
teacher scored (non-zero teacher time); the student evaluated on the rollout engine with the weights of step 0
and of the last step (eval.json `student_weights`). The metrics of the run are copied to MOPD_GPU_JOB_OUT/<config stem>
when set (the device run keeps them for the closing note).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
from gpu_models import ensure_models  # noqa: E402

STEPS = 3


CASES = {
    "local_gpu_colocated": ("local_gpu_colocated", 1, {}),
    "local_gpu_colocated_awex": ("local_gpu_colocated_awex", 1, {}),
    "local_gpu_separated": ("local_gpu_separated", 2, {}),
    "colocated_topk": ("local_gpu_colocated_awex", 1, {"loss.estimator": "topk", "loss.correction": "none"}),
    "colocated_rl": ("local_gpu_colocated_awex", 1, {"loss.rl_coefficient": 0.5}),
    # GRPO with a KL penalty to the reference model (engines/reference.py, the megatron scoring engine)
    "colocated_rl_kl": (
        "local_gpu_colocated_awex",
        1,
        {"loss.rl_coefficient": 0.5, "loss.kl_coefficient": 0.05},
    ),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(CASES))
def test_megatron_actor_teacher_and_awex_through_the_roles(tmp_path: Path, case: str) -> None:
    config, gpus, loss = CASES[case]
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA device(s)")
    pytest.importorskip("megatron.core", reason="megatron-core (the megatron extra) is not installed")
    rollout = yaml.safe_load((REPO / "configs" / f"{config}.yaml").read_text())["rollout"]["backend"]
    if rollout == "sglang":
        pytest.importorskip("sglang", reason="sglang (the sglang extra) is not installed")
    else:
        pytest.importorskip("awex", reason="awex is not installed")
    models = ensure_models(tmp_path / "models", "0.6b", timeout_s=300)  # benchmarks/gpu_models.py
    run_dir = tmp_path / "run"
    overrides = {
        "models.actor.path": models / "student",
        "models.tokenizer.path": models / "student",
        "models.teachers.0.path": models / "teacher",
        "steps": STEPS,
        **loss,
    }
    argv = [sys.executable, "-m", "mopd_hpc.cli.submit", str(REPO / "configs" / f"{config}.yaml"),
            "--local", "--run-dir", str(run_dir)]  # fmt: skip
    for key, value in overrides.items():
        argv += ["--set", f"{key}={value}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOPD_", "SLURM_"))}
    if not env.get("CUDA_VISIBLE_DEVICES"):
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(gpus))
    try:
        proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as exc:  # keep what the run left for the diagnosis, then fail
        proc = subprocess.CompletedProcess(argv, -9, str(exc.stdout or ""), str(exc.stderr or ""))
    keep = os.environ.get("MOPD_GPU_JOB_OUT")
    if keep:
        keep = os.path.join(keep, case)
        os.makedirs(keep, exist_ok=True)
        (Path(keep) / "submit.log").write_text(proc.stdout + "\n----- stderr\n" + proc.stderr)
        for name in ("logs", "metrics.jsonl", "eval.json"):
            if (run_dir / name).is_dir():
                shutil.copytree(run_dir / name, Path(keep) / name, dirs_exist_ok=True)
            elif (run_dir / name).exists():
                shutil.copy(run_dir / name, Path(keep) / name)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
    assert [line["rollout/weight_version"] for line in lines] == [float(s) for s in range(STEPS)]
    for line in lines:
        assert math.isfinite(line["loss/total"]) and math.isfinite(line["mopd/reverse_kl"]), line
        for phase in ("rollout", "teacher", "train", "sync"):
            assert line[f"time/{phase}_s"] > 0, (phase, line)
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())  # the resolved run config
    resolved = {"engine": cfg["models"]["actor"]["engine"], "estimator": cfg["loss"]["estimator"],
                "correction": cfg["loss"]["correction"], "rl_coefficient": cfg["loss"]["rl_coefficient"],
                "kl_coefficient": cfg["loss"]["kl_coefficient"]}  # fmt: skip
    for key, value in loss.items():
        assert resolved[key.removeprefix("loss.")] == value, (key, resolved)
    if resolved["kl_coefficient"] > 0:  # the reference model scored every step: KL(π_θ ‖ π_ref) ≥ 0, finite
        assert all(math.isfinite(line["ref/kl"]) and line["ref/kl"] >= -1e-6 for line in lines), lines
        # step 1 trains from the reference's own weights: KL 0 up to bf16 forward differences between the
        # scoring engine and the actor's forward (measured 0.0 on the H200)
        assert abs(lines[0]["ref/kl"]) <= 1e-3, lines[0]
    if keep:
        phases = {k: [line[k] for line in lines] for k in lines[0] if k.startswith("time/")}
        losses = {k: [line[k] for line in lines] for k in lines[0] if k.startswith(("loss/", "mopd/"))}
        summary = {"case": case, "config": f"configs/{config}.yaml", "overrides": loss, **resolved,
                   "steps": STEPS, "phases_s": phases, "losses": losses}  # fmt: skip
        (Path(keep) / "summary.json").write_text(json.dumps(summary, indent=1))
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_")) == [
        "step_000002",
        "step_000003",
    ]
    assert (run_dir / "student_final" / "config.json").is_file()
    record = json.loads((run_dir / "eval.json").read_text())
    assert record["routes"]["chain"]["n"] == 16
    # the student evaluated on the rollout engine after the first (step 0) and the last weight sync
    assert record["student_weights"] == {"start": "0", "end": str(STEPS)}, record
