"""A megatron Qwen3-MoE (expert_parallel 1) or Llama actor in the colocated job on one GPU: seconds per phase (issue 33).

    python benchmarks/moe_step.py                      # GPU: 3 steps, writes benchmarks/results/moe_step.json
    python benchmarks/moe_step.py --router-loss        # megatron-core's load-balancing loss on: moe_step_router_loss.json
    python benchmarks/moe_step.py --student llama      # a Llama 3.x student (dense): llama_step.json
    python benchmarks/moe_step.py --steps 5 --shape 32x4x128

Runs `mopd-submit configs/local_gpu_colocated.yaml --local` (megatron actor and teacher, the HF rollout
engine, all on GPU 0) with the overrides of `gpu_memory.job_sets` (--steps steps, no evaluation, the step's
PROMPTSxSAMPLESxNEW_TOKENS shape) and:

- the student a random Qwen3-MoE (`moe_mismatch.SHAPE`: 4 layers, 16 experts of f_e 256, top 4, vocabulary 8,192,
  bf16; routers N(0, 0.05²)), the teacher a random dense Qwen3 (`gpu_models.SHAPES["tiny"]`, the same
  vocabulary), both with the character tokenizer, made once under --models-root by a child process (this one
  opens no CUDA context: the children's memory is what is measured);
- `rollout.backend=hf`: the HF engine's routing is the one `moe_mismatch.py` measured (`--set
  rollout.backend=sglang --set rollout.compile_decode=true`: the shipped config's SGLang rollout, which ran a
  Qwen3-MoE and a Llama here too: results/moe_step_sglang.json, llama_step_sglang.json);
- `weight_sync.backend=ipc`: the megatron actor sends each expert under its checkpoint name and the HF
  rollout engine loads it into transformers' fused experts (`engines/expert_names.py`); AWEX into the fused
  experts (`engines/weight_sync/awex_hf.py`) has its own GPU test, tests/engines/test_awex_hf_gpu.py[qwen3_moe];
- `rollout.compile_decode=false`: the eager static decoder, the baseline (`--set rollout.compile_decode=true`
  compiles the MoE decode step too: 0.16 s against 0.55 s a rollout, after a 39 s first step;
  results/moe_step_compiled.json);
- `loss.router_aux_loss_coefficient=0`: no router loss in these steps; `--router-loss` leaves the config's
  (null: the checkpoint's `router_aux_loss_coef`, 0.001) so that megatron-core adds its load-balancing loss
  (`engines/megatron/router_losses.py`), recorded per step as `router/load_balancing_loss`.

`--student llama`: the student a random Llama 3.x instead (`LLAMA`: 4 layers, the llama3 RoPE scaling ×8,
untied embeddings, the same vocabulary and tokenizer), the rest as above (no router loss: a dense model).

Before this benchmark ran, megatron's Qwen3-MoE and Llama were refused as unverified; its first records
(moe_step.json, llama_step.json) carry the `allow_unverified=true` that lifted that refusal.

From the run's metrics.jsonl: seconds per phase per step (`time/<phase>_s`) and their medians over steps 2..
(step 1 is the warm-up), the mismatch `mopd/logprob_mismatch` and `mopd/ratio_capped_frac` per step (megatron
forward vs the HF rollout's μ, no routing replay), the loss and reverse KL, the peak reserved GiB per child and phase and the
memory plan against them (`gpu_memory.plan_against`). Writes --out and, with the OUT environment variable set
(the device machine's output folder), the same file and the job's logs under it. Runtime on an H100: ~2 min.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_memory import (  # noqa: E402
    STEP_PHASES,
    child_peaks,
    gpu_capacity_gib,
    job_sets,
    measured_totals,
    plan_against,
    run_job,
)
from results_file import commit_of, write_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
#: What the MoE actor changes in the shipped config (module docstring).
MOE_SETS = ("rollout.backend=hf", "weight_sync.backend=ipc",
            "weight_sync.awex_mode=null", "rollout.compile_decode=false",
            "loss.router_aux_loss_coefficient=0")  # fmt: skip
PER_STEP = ("mopd/logprob_mismatch", "mopd/ratio_capped_frac", "loss/total", "mopd/reverse_kl",
            "router/load_balancing_loss")  # fmt: skip
#: The Llama student of `--student llama` (transformers LlamaConfig fields): Llama 3.1's RoPE scaling.
LLAMA = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=131072, rope_theta=500000.0,
             rms_norm_eps=1e-5, tie_word_embeddings=False,
             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192})  # fmt: skip
STUDENTS = ("qwen3_moe", "llama")


def make_models(directory: Path, student: str = "qwen3_moe") -> Path:
    """`directory`/student (the Qwen3-MoE, or the Llama of LLAMA) and /teacher (the dense tiny Qwen3), bf16,
    char tokenizer each."""
    import torch
    from gpu_models import SHAPES, make_checkpoint
    from moe_mismatch import make_moe

    from mopd_hpc.data.tokenizer import build_char_tokenizer

    if student == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**LLAMA)).to(torch.bfloat16).save_pretrained(str(directory / "student"))
    else:
        make_moe(directory / "student", router_std=0.05, dtype=torch.bfloat16)
    build_char_tokenizer().save_pretrained(str(directory / "student"))
    make_checkpoint(SHAPES["tiny"], directory / "teacher", seed=1, tokenizer=True)
    return directory


def ensure_models(directory: Path, student: str = "qwen3_moe") -> Path:
    """`make_models` in a child process unless `directory`/student/config.json exists."""
    if not (directory / "student" / "config.json").exists():
        argv = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--make-models",
            str(directory),
            "--student",
            student,
        ]
        subprocess.run(argv, check=True, timeout=300, cwd=REPO)
    return directory


def job_overrides(student: str, router_loss: bool) -> tuple[str, ...]:
    """MOE_SETS for `student`, without the router-loss override when `router_loss` (or for a dense Llama)."""
    keep_loss = router_loss or student == "llama"
    return tuple(x for x in MOE_SETS if not (keep_loss and x.startswith("loss.router_aux_loss_coefficient")))


def summarize(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of the run's metrics lines (module docstring)."""
    measured = [x for x in lines if x["step"] >= 2]
    out: dict[str, Any] = {
        "steps_done": len(lines),
        "seconds_per_phase": {
            ph: [round(x.get(f"time/{ph}_s", float("nan")), 4) for x in lines] for ph in STEP_PHASES
        },
        "per_step": {key: [x.get(key) for x in lines] for key in PER_STEP},
        "peak_reserved_gib": child_peaks(lines),
    }
    if measured:
        out["median_seconds_per_phase_from_step_2"] = {
            ph: round(statistics.median(x.get(f"time/{ph}_s", 0.0) for x in measured), 4)
            for ph in STEP_PHASES
        }
        out["median_step_s_from_step_2"] = round(
            statistics.median(sum(x.get(f"time/{ph}_s", 0.0) for ph in STEP_PHASES) for x in measured), 4
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--shape", default="16x4x64", help="PROMPTSxSAMPLESxNEW_TOKENS (default: %(default)s)")
    p.add_argument("--models-root", type=Path, default=REPO / ".cache" / "models" / "moe_step")
    p.add_argument("--deadline-s", type=float, default=200.0, help="stop the job after this many seconds")
    p.add_argument("--make-models", type=Path, default=None, help="write the models to this folder and exit")
    p.add_argument("--student", choices=STUDENTS, default="qwen3_moe")
    p.add_argument("--router-loss", action="store_true", help="keep the config's router load-balancing loss")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="one more override (replaces ours)"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="default: results/{moe_step,moe_step_router_loss,llama_step}.json",
    )
    p.add_argument("--commit", default=None)
    args = p.parse_args(argv)
    if args.make_models is not None:
        make_models(args.make_models, args.student)
        return 0
    if args.out is None:
        name = (
            "llama_step"
            if args.student == "llama"
            else "moe_step_router_loss"
            if args.router_loss
            else "moe_step"
        )
        args.out = RESULTS / f"{name}.json"
    if args.models_root == p.get_default("models_root") and args.student != "qwen3_moe":
        args.models_root = args.models_root.with_name(f"moe_step_{args.student}")
    prompts, samples, new = (int(x) for x in args.shape.split("x"))
    models = ensure_models(args.models_root, args.student)
    overrides = job_overrides(args.student, args.router_loss)
    keys = {x.split("=", 1)[0] for x in args.set}
    overrides = (*(x for x in overrides if x.split("=", 1)[0] not in keys), *args.set)
    sets = [*job_sets(models, args.steps, prompts, samples, new), *overrides]
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    work = Path(tempfile.mkdtemp(prefix="moe_step_"))
    run_dir, log = work / "run", (out_dir or work) / f"{args.out.stem}_submit.log"
    code, seconds = run_job(sets, run_dir, args.deadline_s, log)
    metrics = run_dir / "metrics.jsonl"
    lines = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    if out_dir is not None and (run_dir / "logs").is_dir():
        shutil.copytree(run_dir / "logs", out_dir / f"{args.out.stem}_logs", dirs_exist_ok=True)
    figures = summarize(lines)
    result = {
        "commit": commit_of(args.commit),
        "shape": {"prompts": prompts, "samples_per_prompt": samples, "max_new_tokens": new},
        "student": args.student,
        "sets": sets[len(sets) - len(overrides) :],
        "exit_code": code,
        "stopped_at_deadline": code is None,
        "wall_s": round(seconds, 1),
        **figures,
    }
    if lines:
        result |= plan_against(sets, gpu_capacity_gib(), measured_totals(lines))
        result["device"] = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0))"],
            capture_output=True, text=True, check=False,
        ).stdout.strip()  # fmt: skip
    print(f"exit {code}, {len(lines)} steps, {seconds:.1f} s")
    for i in range(len(lines)):
        cells = " | ".join(f"{ph} {figures['seconds_per_phase'][ph][i]:.3f}" for ph in STEP_PHASES)
        router = figures["per_step"]["router/load_balancing_loss"][i]
        print(
            f"step {i + 1}: {cells} | mismatch {figures['per_step']['mopd/logprob_mismatch'][i]} | lb {router}"
        )
    if out_dir is not None:
        write_results(out_dir / args.out.name, result)
    write_results(args.out, result)
    return 0 if code == 0 and len(lines) == args.steps else 1


if __name__ == "__main__":
    raise SystemExit(main())
