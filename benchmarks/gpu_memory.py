"""Seconds and peak GPU memory per phase per child through the job's roles on one GPU, against the memory plan
(issue 21).

    python benchmarks/gpu_memory.py --shape 64x4x256 --shape 64x4x1024      # writes results/gpu_memory.json

Each shape (prompts × samples × new tokens) runs `mopd-submit configs/local_gpu_colocated.yaml --local` (the
megatron actor and teacher, the rollout engine and weight sync it ships — sglang + ipc since issue 35, hf +
AWEX colocate in the results before it —, all on GPU 0; random Qwen3-0.6B-shape models
made by `benchmarks/gpu_models.py`) for `--steps` steps with `data.eval.size: 0`, every knob of
memory at its default (micro_batch_tokens null: the engine derives its budget from the free memory;
teacher residency auto). From its metrics.jsonl:

- seconds per phase per step (`time/<phase>_s`);
- peak reserved GiB per child and phase (`memory/<child>/<phase>/reserved_gib`: the actor's phases, the
  teacher's and rollout engine's phases and `held`, what they keep between their requests; an sglang
  engine's: its whole process tree's, from the driver, engines/rollout/tree_memory.py), the max over the steps;
- the GPU's measured total per phase (rollout, teacher, drain, train, sync): Σ over the children of their
  peak in that phase (a server without a request in it: its `held`), and the largest;
- the memory plan (`plan/residency_plan.planned_residency` with the GPU's memory as the job detects it):
  per phase and its largest, the ratio plan / measured (issue 21 asks for 1 ≤ ratio ≤ 1.25), and the
  residency decision.

The results file keeps the shapes it has and replaces those run again (one device call per shape can build it
up); it is rewritten after each shape, so that a run stopped by `--deadline-s` keeps what it had (a shape cut
short reports the steps it finished). Each shape records the commit it ran. Prints one table per shape.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpu_models import ensure_models  # noqa: E402
from results_file import commit_of, write_results  # noqa: E402

from mopd_hpc.config import load_run_config  # noqa: E402
from mopd_hpc.plan.memory_plan import GIB, PHASES  # noqa: E402
from mopd_hpc.plan.placement import place_children  # noqa: E402
from mopd_hpc.plan.residency_plan import gpu_bytes, planned_residency  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CONFIG = REPO / "configs" / "local_gpu_colocated.yaml"
STEP_PHASES = ("rollout", "teacher", "drain", "train", "sync")


def gpu_capacity_gib() -> float:
    """GPU 0's memory as the job detects it (torch's total_memory), from a child process (no context here)."""
    code = "import torch; print(torch.cuda.get_device_properties(0).total_memory)"
    return int(subprocess.check_output([sys.executable, "-c", code], text=True).strip()) / GIB


def run_job(
    sets: list[str], run_dir: Path, timeout_s: float, log: Path, config: Path = CONFIG
) -> tuple[int | None, float]:
    """mopd-submit `config` --local with `sets`; (exit code or None when stopped at `timeout_s`, seconds)."""
    argv = [sys.executable, "-m", "mopd_hpc.cli.submit", str(config), "--local", "--run-dir", str(run_dir)]
    for s in sets:
        argv += ["--set", s]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOPD_", "SLURM_"))}
    env.setdefault("CUDA_VISIBLE_DEVICES", "0")
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(argv, cwd=run_dir.parent, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            return proc.wait(timeout=max(1.0, timeout_s)), time.perf_counter() - t0
        except subprocess.TimeoutExpired:
            for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=wait)
                    break
                except (subprocess.TimeoutExpired, ProcessLookupError):
                    continue
            return None, time.perf_counter() - t0


def child_peaks(lines: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """child → phase → the largest reserved GiB over `lines`."""
    out: dict[str, dict[str, float]] = {}
    for line in lines:
        for key, value in line.items():
            if key.startswith("memory/") and key.endswith("/reserved_gib"):
                child, phase = key[len("memory/") : -len("/reserved_gib")].rsplit("/", 1)
                out.setdefault(child, {})
                out[child][phase] = max(out[child].get(phase, 0.0), float(value))
    return out


def measured_totals(lines: list[dict[str, Any]]) -> dict[str, float]:
    """phase → the largest over the steps of Σ children's reserved GiB in it (a child without the phase: its
    `held`; the actor has every phase)."""
    totals: dict[str, float] = {}
    for line in lines:
        peaks = child_peaks([line])
        for phase in (*PHASES, "drain", "sync"):
            total = sum(ph.get(phase, ph.get("held", 0.0)) for ph in peaks.values())
            totals[phase] = max(totals.get(phase, 0.0), total)
    return totals


def plan_of(sets: list[str], capacity: float, config: Path = CONFIG) -> dict[str, Any]:
    cfg = load_run_config(str(config), sets, False)
    decision, gpus = planned_residency(cfg, place_children(cfg), capacity_gib=capacity)
    (gpu,) = gpus
    kept = frozenset(c.teacher for c in gpu.children if c.teacher and c.teacher not in decision.offload)
    per_phase = {ph: sum(c.in_phase(ph) for c in gpu.children) / GIB for ph in PHASES}
    return {
        "per_phase_gib": per_phase,
        "peak_gib": max(per_phase.values()),
        "with_cuda_contexts_gib": gpu_bytes(gpu, kept)[0] / GIB,
        "children": {c.label: {h.what: round(h.bytes / GIB, 3) for h in c.holdings} for c in gpu.children},
        "residency": list(decision.reasons),
        "offloaded_teachers": sorted(decision.offload),
    }


def plan_against(
    sets: list[str], capacity: float, measured: dict[str, float], config: Path = CONFIG
) -> dict[str, Any]:
    """{"plan": `plan_of(sets, capacity, config)`, "plan_over_measured": its peak over the largest of `measured`
    (phase → GiB, `measured_totals`), None when nothing was measured} (issue 21 asks 1 ≤ ratio ≤ 1.25)."""
    plan = plan_of(sets, capacity, config)
    peak = max(measured.values(), default=0.0)
    return {"plan": plan, "plan_over_measured": plan["peak_gib"] / peak if peak else None}


def job_sets(models: Path, steps: int, prompts: int, samples: int, new: int) -> list[str]:
    """The `--set` overrides of a benchmark run of CONFIG: the models made in `models` (student/, teacher/),
    `steps` steps with one checkpoint (the last), no evaluation, the step's shape."""
    return [
        f"models.actor.path={models / 'student'}", f"models.tokenizer.path={models / 'student'}",
        f"models.teachers.0.path={models / 'teacher'}", f"steps={steps}", f"checkpoint_interval={steps}",
        "data.eval.size=0", f"data.batch_size={prompts}", f"data.samples_per_prompt={samples}",
        f"rollout.sampling.max_new_tokens={new}",
    ]  # fmt: skip


def one_shape(
    shape: str, models: Path, steps: int, timeout_s: float, capacity: float, keep: Path, commit: str
) -> dict:
    prompts, samples, new = (int(x) for x in shape.split("x"))
    sets = job_sets(models, steps, prompts, samples, new)
    work = Path(tempfile.mkdtemp(prefix=f"gpu_memory_{shape}_"))
    run_dir = work / "run"
    keep.mkdir(parents=True, exist_ok=True)
    code, seconds = run_job(sets, run_dir, timeout_s, keep / f"{shape}_submit.log")
    metrics = run_dir / "metrics.jsonl"
    lines = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    if (run_dir / "logs").is_dir():
        subprocess.run(["cp", "-r", str(run_dir / "logs"), str(keep / f"{shape}_logs")], check=False)
    measured = measured_totals(lines)
    peak = max(measured.values(), default=0.0)  # every phase of the step, drain and sync too
    return {
        "shape": {"prompts": prompts, "samples_per_prompt": samples, "max_new_tokens": new},
        "commit": commit,
        "exit_code": code,
        "stopped_at_timeout": code is None,
        "wall_s": round(seconds, 1),
        "steps_done": len(lines),
        "seconds_per_phase": {
            ph: [round(x.get(f"time/{ph}_s", float("nan")), 4) for x in lines] for ph in STEP_PHASES
        },
        "peak_reserved_gib": child_peaks(lines),
        "measured_gpu_gib_per_phase": measured,
        "measured_peak_gib": peak,
        **plan_against(sets, capacity, measured),
        "micro_batches": [x.get("train/micro_batches") for x in lines],
    }


def table(name: str, r: dict) -> str:
    rows = [f"{name}: exit {r['exit_code']}, {r['steps_done']} steps, {r['wall_s']} s"]
    rows.append("step | " + " | ".join(f"{ph} s" for ph in STEP_PHASES))
    for i in range(r["steps_done"]):
        rows.append(f"{i + 1} | " + " | ".join(f"{r['seconds_per_phase'][ph][i]:.3f}" for ph in STEP_PHASES))
    rows.append(
        "peak reserved GiB: child | " + " | ".join(("rollout", "teacher", "drain", "train", "sync", "held"))
    )
    for child, phases in sorted(r["peak_reserved_gib"].items()):
        cells = [f"{phases[ph]:.2f}" if ph in phases else "-" for ph in (*STEP_PHASES, "held")]
        rows.append(f"  {child} | " + " | ".join(cells))
    m, p = r["measured_gpu_gib_per_phase"], r["plan"]["per_phase_gib"]
    rows.append("GPU GiB: phase | measured | plan")
    for ph in PHASES:
        rows.append(f"  {ph} | {m.get(ph, 0.0):.2f} | {p[ph]:.2f}")
    ratio = r["plan_over_measured"]
    rows.append(f"plan / measured peak: {ratio:.3f}" if ratio else "plan / measured peak: -")
    rows += [f"  {line}" for line in r["plan"]["residency"]]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", action="append", default=None, help="PROMPTSxSAMPLESxNEW (repeatable)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--models", type=Path, default=None, help="made here when absent (gpu_models.py)")
    p.add_argument("--deadline-s", type=float, default=540.0, help="stop the last shape at this many seconds")
    p.add_argument("--keep", type=Path, default=None, help="where each shape's submit log and logs/ go")
    p.add_argument("--commit", default=None, help="the commit to record (default: git rev-parse HEAD)")
    p.add_argument("--out", type=Path, default=RESULTS / "gpu_memory.json")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    shapes = args.shape or ["64x4x256", "64x4x1024"]
    models = args.models or Path(tempfile.mkdtemp(prefix="gpu_memory_models_"))
    ensure_models(models, "0.6b", timeout_s=None)  # in a child: no CUDA context in this process
    capacity = gpu_capacity_gib()
    keep = args.keep or Path(tempfile.mkdtemp(prefix="gpu_memory_logs_"))
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    result: dict[str, Any] = previous | {
        "benchmark": "gpu_memory",
        "config": str(CONFIG.relative_to(REPO)),
        "gpu_capacity_gib": capacity,
        "models": "random Qwen3-0.6B shape (28 layers, hidden 1024, vocab 151,936), bf16; char tokenizer",
        "defaults": "micro_batch_tokens null (derived), activation_checkpointing false, teacher residency auto",
        "shapes": dict(previous.get("shapes", {})),
    }
    for shape in shapes:
        left = args.deadline_s - (time.perf_counter() - t0)
        r = one_shape(shape, models, args.steps, left, capacity, keep, commit_of(args.commit))
        result["shapes"][shape] = r
        print(table(shape, r), flush=True)
        write_results(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
